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
from workers.model_runner import ModelRunner, PromptLogitRows
from workers.sampler import Sampler, SamplingTensors, token_logprobs
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerConfig
from workers.sequence import FinishReason, Sequence

TopList = list[tuple[int, float]]


@dataclass(frozen=True)
class EngineLimits:
    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024**2
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of one choice of one request, produced by one step."""

    request_id: int
    index: int  # the choice (0 .. n-1)
    token_id: int
    finish_reason: FinishReason | None
    stop_token_id: int | None
    time: float  # perf_counter() when the step finished
    logprob: float | None = None  # when the request asks for logprobs
    top_logprobs: TopList | None = None
    # On a request's first event only, when asked: (token id, logprob, top) per prompt token after the first.
    prompt_logprobs: list[tuple[int, float, TopList]] | None = None


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
        self._requests: dict[int, list[Sequence]] = {}  # request id -> its live choices

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
        # The n choices share the prompt's blocks and each grows its own output.
        kv_needed = len(prompt_token_ids) + params.n * params.max_tokens
        capacity = self.blocks.max_tokens_capacity()
        if kv_needed > capacity:
            raise CapacityError(
                f"The request needs {kv_needed} tokens of KV cache; this worker's cache holds {capacity}."
            )

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Queue a request; returns its id. Choices 1..n-1 fork from choice 0 after the prompt."""
        self.check_request(prompt_token_ids, params)
        seq = Sequence(
            seq_id=next(self._ids),
            token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.limits.max_model_len,
        )
        self._requests[seq.request_id] = [seq]
        self.scheduler.add(seq)
        return seq.request_id

    def abort_request(self, request_id: int) -> None:
        for seq in self._requests.pop(request_id, []):
            self.scheduler.abort(seq)

    def is_active(self, request_id: int) -> bool:
        return request_id in self._requests

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_active(self) -> int:
        return len(self._requests)

    def step(self) -> list[TokenEvent]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        self.kv_cache.copy_blocks(batch.block_copies)
        logits, prompt_rows = self.runner.forward(batch.decodes, batch.prefills)
        logits = logits[:, : self.vocab_size]
        chunks = batch.sampling_chunks
        self.scheduler.advance(batch)
        self._score_prompts(logits[len(chunks) :], prompt_rows)
        seqs, rows = self._sampling_rows([c.seq for c in chunks])
        if not seqs:
            return []
        row_logits = logits[rows]
        tensors = SamplingTensors.from_sequences(seqs, self.vocab_size, self.device)
        tokens = self.sampler(row_logits, tensors)
        logprobs = self._logprobs(seqs, row_logits, tokens)
        results = self.scheduler.append_tokens(seqs, tokens.tolist())
        return self._events(results, logprobs)

    def _sampling_rows(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """Each sampling sequence's logits row; an n > 1 request forks its choices here, so
        all n draw their first token from the one prefill."""
        out_seqs: list[Sequence] = []
        rows: list[int] = []
        for row, seq in enumerate(seqs):
            out_seqs.append(seq)
            rows.append(row)
            if seq.needs_fork:
                children = [seq.fork(next(self._ids), i) for i in range(1, seq.params.n)]
                self.scheduler.fork(seq, children)
                self._requests[seq.request_id].extend(children)
                out_seqs.extend(children)
                rows.extend([row] * len(children))
        return out_seqs, rows

    def _logprobs(self, seqs: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor) -> dict[int, tuple]:
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not wanted:
            return {}
        top_k = max(seqs[i].params.logprobs for i in wanted)
        index = torch.tensor(wanted, device=logits.device)
        chosen, tops = token_logprobs(logits[index], tokens[index], top_k)
        return {
            row: (lp, top[: seqs[row].params.logprobs]) for row, lp, top in zip(wanted, chosen, tops)
        }

    def _score_prompts(self, logits: torch.Tensor, prompt_rows: list[PromptLogitRows]) -> None:
        offset = 0
        for rows in prompt_rows:
            seq = rows.seq
            part = logits[offset : offset + rows.count]
            offset += rows.count
            first = rows.first_position
            targets = torch.tensor(seq.token_ids[first + 1 : first + 1 + rows.count], device=part.device)
            chosen, tops = token_logprobs(part, targets, seq.params.prompt_logprobs)
            seq.prompt_logprobs.extend(zip(targets.tolist(), chosen, tops))

    def _events(self, results, logprobs: dict[int, tuple]) -> list[TokenEvent]:
        now = time.perf_counter()
        events = []
        for row, (seq, token, reason) in enumerate(results):
            if reason is not None:
                self._retire(seq)
            lp, top = logprobs.get(row, (None, None))
            first = seq.num_output_tokens == 1 and seq.index == 0 and seq.params.prompt_logprobs is not None
            events.append(
                TokenEvent(
                    request_id=seq.request_id,
                    index=seq.index,
                    token_id=token,
                    finish_reason=reason,
                    stop_token_id=seq.stop_token_id,
                    time=now,
                    logprob=lp,
                    top_logprobs=top,
                    prompt_logprobs=list(seq.prompt_logprobs) if first else None,
                )
            )
        return events

    def _retire(self, seq: Sequence) -> None:
        group = self._requests.get(seq.request_id)
        if group is None:
            return
        group.remove(seq)
        if not group:
            del self._requests[seq.request_id]
