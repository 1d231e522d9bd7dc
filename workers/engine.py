"""The synchronous engine: add requests, run steps, abort. One model step per `step()`.

Everything here runs on one thread (the engine thread in production, the test thread
in unit tests); async_engine.py puts it behind asyncio streams.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from workers.block_manager import BlockManager
from workers.kv_cache import KVCacheShape, PagedKVCache
from workers.model_runner import ModelRunner
from workers.sampler import Sampler, SamplingTensors
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerConfig
from workers.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class EngineLimits:
    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024**2
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of one sequence, produced by one step."""

    seq_id: int
    token_id: int
    finish_reason: FinishReason | None
    stop_token_id: int | None
    time: float  # perf_counter() when the step finished


class CapacityError(ValueError):
    """The request can never fit in this engine (context window or KV pool)."""


class LLMEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: frozenset[int],
        limits: EngineLimits,
        device: torch.device,
    ) -> None:
        self.limits = limits
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        shape = KVCacheShape.from_model_config(model.config, model.dtype)
        num_blocks = shape.num_blocks_for_budget(limits.kv_cache_bytes, limits.block_size)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache budget {limits.kv_cache_bytes} bytes holds no block of {limits.block_size} "
                f"tokens at {shape.bytes_per_token} bytes per token"
            )
        self.kv_cache = PagedKVCache(shape, num_blocks, limits.block_size, device)
        self.blocks = BlockManager(num_blocks, limits.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(limits.max_num_seqs, limits.max_num_batched_tokens), self.blocks
        )
        self.runner = ModelRunner(model, self.kv_cache, device)
        self.sampler = Sampler()
        self._ids = itertools.count()
        self._seqs: dict[int, Sequence] = {}

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise CapacityError if the request can never run here. Reads only fixed limits,
        so any thread may call it."""
        needed = len(prompt_token_ids) + params.max_tokens
        if needed > self.limits.max_model_len:
            raise CapacityError(
                f"This model's maximum context length is {self.limits.max_model_len} tokens. However, you "
                f"requested {needed} tokens ({len(prompt_token_ids)} in the messages, "
                f"{params.max_tokens} in the completion)."
            )
        capacity = self.blocks.max_tokens_capacity()
        if needed > capacity:
            raise CapacityError(
                f"The request needs {needed} tokens of KV cache; this worker's cache holds {capacity}."
            )

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        self.check_request(prompt_token_ids, params)
        seq = Sequence(
            seq_id=next(self._ids),
            token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.limits.max_model_len,
        )
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def abort_request(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.scheduler.abort(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_active(self) -> int:
        return len(self._seqs)

    def step(self) -> list[TokenEvent]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        logits = self.runner.forward(batch.decodes, batch.prefills)
        seqs = [c.seq for c in batch.sampling_chunks]
        sampled: list[int] = []
        if seqs:
            tensors = SamplingTensors.from_sequences(seqs, self.vocab_size, self.device)
            sampled = self.sampler(logits[:, : self.vocab_size], tensors).tolist()
        results = self.scheduler.complete_step(batch, sampled)
        now = time.perf_counter()
        events = []
        for seq, token, reason in results:
            if reason is not None:
                self._seqs.pop(seq.seq_id, None)
            events.append(TokenEvent(seq.seq_id, token, reason, seq.stop_token_id, now))
        return events
