"""A worker replica's group of shards: where each stands (its pipeline stage and its rank
among that stage's tensor shards), the collectives the split forward needs, and the step
message the driver (shard 0) sends the other shards once a step.

The collectives are the Megatron ones: a sum across shards after each row-split product
(attention's o_proj, the MLP's down_proj), the vocabulary-split embedding (each shard
looks up the ids in its rows, the rest are zeros, one sum), and the vocabulary-split
logits gathered to the stage's first shard. They run within one pipeline stage's tensor
shards (a subgroup when there are several stages); the step message goes to every shard,
and hidden states pass from each tensor shard to the same rank of the next stage. gloo on
CPU, NCCL on CUDA.
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


@dataclass(frozen=True)
class ShardLayout:
    """A replica's shards: `stages` pipeline stages of `tensor` tensor shards each. Shard
    r is tensor rank r % tensor of stage r // tensor; shard 0, the driver, is rank 0 of
    stage 0."""

    tensor: int = 1
    stages: int = 1

    @property
    def world(self) -> int:
        return self.tensor * self.stages

    def position(self, shard: int) -> TensorRank:
        return TensorRank(shard % self.tensor, self.tensor)

    def stage_of(self, shard: int) -> int:
        return shard // self.tensor

    def shard_of(self, stage: int, tensor_rank: int) -> int:
        return stage * self.tensor + tensor_rank


def free_init_method(host: str = "127.0.0.1") -> str:
    """A `tcp://host:port` rendezvous on a port free now (rank 0 listens there)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return f"tcp://{host}:{probe.getsockname()[1]}"


class ShardGroup:
    """This process's place in its replica's group (one group per process: torch's
    default). `rank` and `world` are its place among its stage's tensor shards (what the
    split and the collectives go by); `shard` its place in the whole replica."""

    def __init__(self, shard: int, layout: ShardLayout, init_method: str, device: torch.device,
                 timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Joins the group; returns once every shard has joined (shard 0 hosts the rendezvous)."""
        self.shard = shard
        self.layout = layout
        self.position = layout.position(shard)
        self.stage = layout.stage_of(shard)
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=shard, world_size=layout.world,
                                timeout=timeout)
        self._tensor_group = None  # the whole world: one stage
        if layout.stages > 1 and layout.tensor > 1:
            # Every process makes every stage's subgroup, in the same order (torch requires it).
            for stage in range(layout.stages):
                ranks = [layout.shard_of(stage, r) for r in range(layout.tensor)]
                subgroup = dist.new_group(ranks, timeout=timeout)
                if stage == self.stage:
                    self._tensor_group = subgroup
        self._stage_leader = layout.shard_of(self.stage, 0)
        self._sending: list[tuple[dist.Work, torch.Tensor]] = []

    @property
    def rank(self) -> int:
        return self.position.rank

    @property
    def world(self) -> int:
        return self.position.world

    @property
    def is_driver(self) -> bool:
        return self.shard == 0

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of this stage's tensor shards' `x`, in place."""
        dist.all_reduce(x, group=self._tensor_group)
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
        """[K, vocab] on the stage's tensor rank 0 from each tensor shard's columns [K, its
        part]; None elsewhere."""
        per = -(-vocab_size // self.world)
        if local.shape[-1] < per:  # the last part is shorter: every shard sends equal shapes
            local = F.pad(local, (0, per - local.shape[-1]))
        local = local.contiguous()
        leader = self.shard == self._stage_leader
        parts = [torch.empty_like(local) for _ in range(self.world)] if leader else None
        dist.gather(local, parts, dst=self._stage_leader, group=self._tensor_group)
        return torch.cat(parts, dim=-1)[..., :vocab_size] if parts is not None else None

    def send_tensor(self, x: torch.Tensor, stage: int) -> None:
        """Pipeline: hidden states (or logits) to this tensor rank's shard of `stage`, sent
        while the caller goes on (`wait_sends` ends the step's sends; `x` is kept till then)."""
        x = x.contiguous()
        self._sending.append((dist.isend(x, self.layout.shard_of(stage, self.rank)), x))

    def wait_sends(self) -> None:
        sending, self._sending = self._sending, []
        for work, _ in sending:
            work.wait()

    def receive_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, stage: int) -> torch.Tensor:
        """Pipeline: what this tensor rank's shard of `stage` sends with `send_tensor`."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, self.layout.shard_of(stage, self.rank))
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
