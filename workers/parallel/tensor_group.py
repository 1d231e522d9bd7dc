"""A worker replica's tensor-parallel group: its rank, the collectives the sharded forward
needs, and the step message the driver (rank 0) sends the other shards once a step.

The collectives are the Megatron ones: a sum across shards after each row-split product
(attention's o_proj, the MLP's down_proj), the vocabulary-split embedding (each shard
looks up the ids in its rows, the rest are zeros, one sum), and the vocabulary-split
logits gathered to the driver, which alone samples. gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

# A shard that stops answering (dead, or stuck) fails the step that waits for it after
# this long, instead of hanging the replica: its health check then replaces it.
COLLECTIVE_TIMEOUT_S = 120


@dataclass(frozen=True)
class TensorRank:
    rank: int
    world: int

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """This rank's rows of a vocabulary split in `world` equal parts (the last may be shorter)."""
        per = -(-vocab_size // self.world)
        start = min(vocab_size, self.rank * per)
        return start, min(vocab_size, start + per)


def free_init_method(host: str = "127.0.0.1") -> str:
    """A `tcp://host:port` rendezvous on a port free now (rank 0 listens there)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return f"tcp://{host}:{probe.getsockname()[1]}"


class TensorGroup:
    """This process's place in its replica's group (one group per process: torch's default)."""

    def __init__(self, position: TensorRank, init_method: str, device: torch.device,
                 timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Joins the group; returns once every rank has joined (rank 0 hosts the rendezvous)."""
        self.position = position
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=position.rank, world_size=position.world,
                                timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def rank(self) -> int:
        return self.position.rank

    @property
    def world(self) -> int:
        return self.position.world

    @property
    def is_driver(self) -> bool:
        return self.position.rank == 0

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every shard's `x`, in place."""
        dist.all_reduce(x)
        return x

    def embed(self, rows: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Embeddings of `ids` [T] from a vocabulary split by rows: this shard holds `rows`,
        its part of the `vocab_size` rows."""
        start, end = self.position.vocab_range(vocab_size)
        local = ids - start
        outside = (local < 0) | (local >= end - start)
        out = F.embedding(local.clamp(0, max(end - start - 1, 0)), rows)
        out[outside] = 0
        return self.all_reduce(out)

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[K, vocab] on the driver from each shard's columns [K, its part]; None elsewhere."""
        per = -(-vocab_size // self.world)
        if local.shape[-1] < per:  # the last part is shorter: every shard sends equal shapes
            local = F.pad(local, (0, per - local.shape[-1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.is_driver else None
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=-1)[..., :vocab_size] if parts is not None else None

    def send_tensor(self, x: torch.Tensor, dst: int) -> None:
        """Pipeline: hidden states (or logits) to shard `dst`."""
        dist.send(x.contiguous(), dst)

    def receive_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        """Pipeline: what shard `src` sends with `send_tensor`."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, src)
        return out

    def send(self, message: object) -> None:
        """Driver: one object to every other shard (a step, or None: stop)."""
        dist.broadcast_object_list([message], src=0, device=self._object_device)

    def receive(self) -> object:
        """Shard: the driver's next `send`."""
        box = [None]
        dist.broadcast_object_list(box, src=0, device=self._object_device)
        return box[0]

    @property
    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None
