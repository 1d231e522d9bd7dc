"""The synchronous engine: add requests, run steps, abort. One model step per `step()`.

Everything here runs on one thread (the engine thread in production, the test thread
in unit tests); workers/serving/async_engine.py puts it behind asyncio streams.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from workers.contract.grammar import GuidedDecodingError
from workers.contract.sampling_params import SamplingParams
from workers.core.adapter_slots import AdapterSlots
from workers.core.batch import ScheduledBatch, ScheduledChunk
from workers.core.events import TokenEvent, token_events
from workers.core.images import ImageInputs
from workers.core.limits import CapacityError, EngineLimits, PriorityError
from workers.core.request_table import RequestTable
from workers.core.sequence import Adapter, Sequence
from workers.engine.async_overlap import AsyncOverlap
from workers.engine.beam_coordinator import BeamCoordinator
from workers.engine.block_manager import BlockManager
from workers.engine.choices import choice_logits, fork_choices
from workers.engine.engine_info import (
    EngineDescription,
    EngineStats,
    queued_prompt_tokens,
)
from workers.engine.kv_transfer import (
    KVBlocks,
    export_blocks,
    held_blocks,
    import_blocks,
)
from workers.engine.model_setup import (
    adapter_slots,
    decode_path,
    guided_decoder,
    kv_pool,
    model_runner,
    proposer,
)
from workers.engine.pooling import Pooler, embedding_events
from workers.engine.resume import (
    OutputRules,
    ResumedChoice,
    replay_choices,
    resumed_sequences,
)
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.step_recovery import StepRecovery
from workers.model.batch_invariant import invariant_for_free, make_batch_invariant
from workers.model.cpu_attention import cpu_decode_attention
from workers.model.cuda_graphs import DecodeGraphs
from workers.model.kv_cache import PagedKVCache
from workers.parallel.pipeline import StageLayers
from workers.parallel.shard_group import ShardGroup
from workers.parallel.shard_loop import KVPlan
from workers.sampling.guided import GuideState
from workers.sampling.logprobs import sampled_logprobs, score_prompts
from workers.sampling.sampler import Sampler, SamplingTensors
from workers.speculative.proposals import SpeculationCounts
from workers.speculative.verification import VerifyRows, accepted_count, rows_ahead


class LLMEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: frozenset[int],
        limits: EngineLimits,
        device: torch.device,
        tokenizer=None,
        shard_group: ShardGroup | None = None,
        stage: StageLayers | None = None,
        draft_model: torch.nn.Module | None = None,
    ) -> None:
        """`tokenizer` (a fast HF tokenizer) enables guided decoding; without one, a guided
        request is refused. `shard_group`: `model` is this driver's part of a model split
        over that group (workers/parallel/): by tensors, or by layers when `stage` (the
        first pipeline stage) is given; the other shards mirror its KV pool and run each
        step it sends them. `draft_model`: speculative method 'draft's proposer (the same
        tokenizer, on the same device)."""
        if limits.deterministic is None:  # auto: on where decode pays nothing (a CPU model in quantized blocks)
            free = (device.type == "cpu" and shard_group is None and limits.lora is None
                    and cpu_decode_attention() is not None and invariant_for_free(model))
            limits = dataclasses.replace(limits, deterministic=free)
        self.limits = limits
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.shard_group = shard_group
        if limits.deterministic:  # before the runner: the direct forward holds the layers it finds
            make_batch_invariant(model)
        # A split model's output head holds only this shard's rows of the vocabulary.
        self.vocab_size = model.config.vocab_size if shard_group else model.get_output_embeddings().weight.shape[0]
        shape, num_blocks = kv_pool(model, limits, shard_group.world if shard_group else 1, stage)
        if shard_group is not None:
            shard_group.send(KVPlan(num_blocks, limits.block_size, limits.lora))
        path = decode_path(device, limits, split=shard_group is not None)
        if limits.deterministic and not path.cpu_kernel:
            raise ValueError("engine.deterministic needs the CPU attention kernel (workers/model/cpu_attention.c), "
                             "which needs a C compiler on the worker's host")
        self.kv_cache = PagedKVCache(shape, num_blocks, limits.block_size, device, padding_block=path.graphs)
        self.blocks = BlockManager(num_blocks, limits.block_size, limits.enable_prefix_caching)
        # Before the runner: its CUDA graphs capture the LoRA layers too.
        self.lora: AdapterSlots = adapter_slots(model, limits, shard_group, stage)
        self.proposer = proposer(limits, model, draft_model, num_blocks, device)
        self.scheduler = Scheduler(
            SchedulerConfig(limits.max_num_seqs, limits.max_num_batched_tokens,
                            limits.max_prefill_tokens_while_decoding, limits.priority_scheduling),
            self.blocks, self.lora, self.proposer,
        )
        self.runner = model_runner(model, self.kv_cache, device, path, limits, self.vocab_size, self.lora,
                                   shard_group, stage)
        self.sampler = Sampler()
        self.pooler = Pooler()  # embedding requests' vectors, built over their prompt's chunks
        self.guided = guided_decoder(tokenizer, self.vocab_size, eos_token_ids)
        self._ids = itertools.count()
        self._requests = RequestTable()
        self.beams = BeamCoordinator(self.scheduler, self._requests, self._ids, self.abort_request)
        self.recovery = StepRecovery(self.scheduler, self._requests, self.beams.pending_rows, self.abort_request)
        self.overlap = AsyncOverlap(self.scheduler, self.blocks, self._requests, self._launch_decodes,
                                    limits.async_scheduling)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise CapacityError if the request can never run here, PriorityError if it has a
        priority this engine does not schedule by. Reads only fixed limits, so any thread
        may call it."""
        if params.priority and not self.limits.priority_scheduling:
            raise PriorityError(params.priority)
        needed = len(prompt_token_ids) + params.max_tokens
        if needed > self.limits.max_model_len:
            raise CapacityError(
                f"This model's maximum context length is {self.limits.max_model_len} tokens. However, you "
                f"requested {needed} tokens ({len(prompt_token_ids)} in the prompt, "
                f"{params.max_tokens} in the completion).",
                prompt_alone=len(prompt_token_ids) >= self.limits.max_model_len,
            )
        # The n choices share the prompt's blocks and each grows its own output.
        kv_needed = len(prompt_token_ids) + params.n * params.max_tokens
        capacity = self.blocks.max_tokens_capacity()
        if kv_needed > capacity:
            raise CapacityError(
                f"The request needs {kv_needed} tokens of KV cache; this worker's cache holds {capacity}."
            )

    def compile_guide(self, params: SamplingParams) -> GuideState | None:
        """The grammar state for a guided request (None when unguided); raises
        GuidedDecodingError. Reads only immutable state, so any thread may call it: grammar
        compilation can take milliseconds and is better kept off the engine thread."""
        if params.guided is None:
            return None
        if params.use_beam_search:
            raise GuidedDecodingError("guided decoding is not available with beam search", params.guided.param)
        if self.guided is None:
            raise GuidedDecodingError("this engine has no tokenizer, so it cannot guide decoding", params.guided.param)
        return self.guided.compile(params.guided)

    def replay_output(self, prompt_token_ids: list[int], params: SamplingParams, outputs: dict[int, list[int]],
                      guide: GuideState | None) -> list[ResumedChoice]:
        """A resumed request's choices (choice index -> output ids already produced), replayed
        through the stop rules and the grammar (`guide`, from compile_guide, is copied per
        choice); raises ContinuationError. Reads only fixed state, so any thread may call it."""
        rules = OutputRules(self.eos_token_ids, self.limits.max_model_len, self.vocab_size)
        return replay_choices(prompt_token_ids, outputs, params, guide, rules)

    def check_lora(self, adapter: Adapter) -> None:
        """Raise LoraAdapterError unless this engine can serve `adapter` (LoRA on, targets,
        shapes, rank). Reads only fixed shapes, so any thread may call it."""
        self.lora.check(adapter)

    def add_lora(self, adapter: Adapter) -> None:
        """Register `adapter` for requests that name its key (raises LoraAdapterError)."""
        self.lora.check(adapter)
        self.lora.add(adapter)

    def remove_lora(self, key: str) -> bool:
        """Forget an adapter for new requests (its queued and running ones finish with it)."""
        return self.lora.remove(key)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, guide: GuideState | None = None, *,
                    images: ImageInputs | None = None, resume: list[ResumedChoice] | None = None,
                    lora: str | None = None) -> int:
        """Queue a request; returns its id. Choices 1..n-1 fork from choice 0 after the prompt.
        A guided request's grammar is compiled here unless `guide` (from compile_guide) is given.
        A request's images are encoded here, once (raises ImageEncodeError). `resume`
        (from replay_output, unfinished choices only): go on from output already produced.
        `lora`: the key of a registered adapter (add_lora) to run the request with (raises
        LoraAdapterError)."""
        self.check_request(prompt_token_ids, params)
        adapter = self._adapter(lora)
        if params.guided is not None and guide is None and resume is None:
            guide = self.compile_guide(params)
        salt = images.salt if images is not None else b""
        seq = Sequence(
            seq_id=next(self._ids),
            token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.limits.max_model_len,
            # Another adapter's K/V differ for the same tokens: its blocks never match.
            cache_salt=salt + _salt(adapter.key if adapter is not None else None),
            image_features=self.runner.encode_images(images) if images is not None else None,
            guide=guide,
            lora=adapter,
        )
        seqs = [seq] if resume is None else resumed_sequences(seq, resume, self._ids)
        self._requests.add(seq.request_id, seqs)
        if params.use_beam_search:
            self.beams.start(seq, self.eos_token_ids)
        for choice in seqs:
            self.scheduler.add(choice)
        return seq.request_id

    def export_prefix(self, token_ids: list[int], lora: str | None = None) -> KVBlocks | None:
        """The cached K/V blocks of a prompt (run with adapter `lora`), for another replica
        (workers/engine/kv_transfer.py); None where none is cached, or the model is split
        over shards (each holds its own part of the pool)."""
        if self.shard_group is not None:
            return None
        return export_blocks(self.blocks, self.kv_cache, token_ids, _salt(lora))

    def held_prefix_blocks(self, token_ids: list[int], lora: str | None = None) -> int:
        """How many of a prompt's first full blocks this engine caches already."""
        return held_blocks(self.blocks, token_ids, _salt(lora))

    def import_prefix(self, payload: KVBlocks, lora: str | None = None) -> int:
        """Write another replica's prompt blocks into this one's prefix cache; returns the
        blocks written (0 for a split model)."""
        if self.shard_group is not None:
            return 0
        return import_blocks(self.blocks, self.kv_cache, payload, _salt(lora))

    def _adapter(self, key: str | None) -> Adapter | None:
        if key is None:
            return None
        return self.lora.get(key)

    def abort_request(self, request_id: int) -> None:
        seqs = self._requests.pop(request_id)
        self.beams.forget(request_id, seqs)
        self.pooler.forget(seqs)
        for seq in seqs:
            self.scheduler.abort(seq)

    def has_work(self) -> bool:
        return self.overlap.in_flight is not None or self.scheduler.has_work()

    @property
    def num_active(self) -> int:
        return len(self._requests)

    @property
    def async_steps(self) -> int:
        """Steps launched from a previous step's tokens still on the device."""
        return self.overlap.steps

    def stats(self) -> EngineStats:
        """The engine's load. Plain reads, so another thread may call it (a step may be
        half way: the numbers are a moment's, not one step's)."""
        spec = self.proposer.counts if self.proposer is not None else SpeculationCounts()
        return EngineStats(
            spec_drafts=spec.drafts,
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            active_requests=self.num_active,
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            kv_blocks_used=self.blocks.num_used_blocks,
            kv_blocks_total=self.blocks.num_blocks,
            prefix_cache_query_tokens=self.blocks.query_tokens,
            prefix_cache_hit_tokens=self.blocks.hit_tokens,
            # Each queue copied in one step: the engine thread may change them while another thread reads.
            queued_prompt_tokens=queued_prompt_tokens([*self.scheduler.waiting, *self.scheduler.running]),
        )

    def describe(self) -> EngineDescription:
        """The engine's fixed shape; any thread may call it."""
        graphs = self.decode_graphs
        return EngineDescription(
            max_model_len=self.limits.max_model_len,
            vocab_size=self.vocab_size,
            block_size=self.blocks.block_size,
            num_blocks=self.blocks.num_blocks,
            dtype=str(self.runner.model.dtype).removeprefix("torch."),
            decode_attention=self.runner.decode_attention,
            cuda_graph_max_batch=graphs.max_batch if graphs else 0,
            deterministic=bool(self.limits.deterministic),
        )

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """The captured decode CUDA graphs (None: decode runs eagerly)."""
        return self.runner.decode_graphs

    def step(self) -> list[TokenEvent]:
        """One model step. If it raises, the step is undone and its requests are re-run one
        at a time, so only the request that makes a step fail is failed."""
        if self.overlap.in_flight is not None:
            return self.overlap.step()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        snapshot = self.recovery.snapshot(batch)
        timed_rows, started = self._priced_rows(batch), time.perf_counter()
        try:
            events = self._execute(batch)
        except Exception as exc:  # noqa: BLE001 - contained to the request(s) of this step
            return self.recovery.contain(snapshot, exc)
        if timed_rows and self.overlap.in_flight is None:  # (an overlapped step's time is the next call's)
            self.proposer.step_cost.record(timed_rows, time.perf_counter() - started)
        self.recovery.next_suspect()  # the suspect stepped cleanly
        return events

    def _priced_rows(self, batch: ScheduledBatch) -> int:
        """The rows of a step of decode and verification rows only, whose time prices a
        proposed token (speculative.proposals.StepCost); 0 for any other step."""
        if self.proposer is None or len(batch.drafted) != len(batch.prefills):
            return 0
        return batch.num_tokens

    def _execute(self, batch: ScheduledBatch) -> list[TokenEvent]:
        if self.overlap.can_start(batch):
            self.overlap.start(batch)
            return []  # its tokens come out of the next step() call
        self._copy_blocks(batch.block_copies)
        logits, prompt_rows, pooled = self.runner.forward(batch.decodes, batch.prefills)
        logits = logits[:, : self.vocab_size]
        chunks = batch.sampling_chunks
        self.scheduler.advance(batch)
        score_prompts(logits[len(chunks) :], prompt_rows)
        # Embedding requests end with their prompt: a vector, no sampled token.
        events = embedding_events(self.pooler.add(pooled), self.scheduler, self._requests) if pooled else []
        beam_rows = [i for i, c in enumerate(chunks) if c.seq.params.use_beam_search]
        if beam_rows:
            events += self.beams.step([chunks[i].seq for i in beam_rows], logits[beam_rows])
        sampling_rows = [i for i, c in enumerate(chunks)
                         if not c.seq.params.use_beam_search and c.seq.params.pooling is None]
        seqs = [chunks[i].seq for i in sampling_rows]
        drafted = batch.drafted
        if drafted:  # their first rows follow the prompt-logprob rows
            draft_base = len(chunks) + sum(r.count for r in prompt_rows)
            return events + self._verify(seqs, logits, sampling_rows, drafted, draft_base)
        return events + self._sample(seqs, logits, sampling_rows)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of shared blocks, in this pool and (split model) in every shard's."""
        self.kv_cache.copy_blocks(pairs)
        if pairs and self.shard_group is not None:
            self.runner.direct.record_copies(pairs)

    def close(self) -> None:
        """Let a split model's other shards go (they wait for steps until told)."""
        if self.shard_group is not None:
            self.runner.direct.close()

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, sampling_rows: list[int]) -> list[TokenEvent]:
        """Sample the next token of `seqs` (and of the choices they fork now) from their rows of `logits`."""
        seqs, rows = fork_choices(seqs, self.scheduler, self._requests, self._ids)
        if not seqs:
            return []
        tokens, logprobs = self._draw(seqs, choice_logits(logits, sampling_rows, rows))
        results = self.scheduler.append_tokens(seqs, tokens)
        return token_events(results, logprobs, self._requests)

    def _draw(self, seqs: list[Sequence], row_logits: torch.Tensor, pending: int | list[int] = 0,
              drafts: dict[int, tuple[int, ...]] | None = None) -> tuple[list[int], dict]:
        """A token from each row of `row_logits` (row i: `seqs[i]`'s, `pending` tokens past
        its end; `drafts`: a verification's first row -> the proposals its later rows follow,
        which their penalties count and their grammar masks take), and the log-probabilities
        of the rows that ask."""
        penalised = drafts and any(s.params.has_penalties for s in seqs)
        ahead = rows_ahead(len(seqs), drafts) if penalised else None
        tensors = SamplingTensors.from_sequences(seqs, self.vocab_size, self.device, pending, ahead)
        if self.guided is not None:
            tensors.guided = self.guided.mask([s.guide for s in seqs], self.device, drafts)
        tokens = self.sampler(row_logits, tensors)
        forced = [(row, token) for row, seq in enumerate(seqs) if (token := seq.forced_token()) is not None]
        if forced:  # a thinking budget spent: its end tag, whatever was drawn (the logprob is the model's)
            rows, ids = zip(*forced)
            tokens[list(rows)] = torch.tensor(ids, dtype=tokens.dtype, device=tokens.device)
        return tokens.tolist(), sampled_logprobs(seqs, row_logits, tokens)

    def _verify(self, seqs: list[Sequence], logits: torch.Tensor, sampling_rows: list[int],
                drafted: list[ScheduledChunk], draft_base: int) -> list[TokenEvent]:
        """_sample for a step with verification chunks (`drafted`, their first rows from
        `draft_base` on): each drafted sequence samples all its rows and keeps its proposals
        while they match (workers/speculative/verification.py)."""
        seqs, rows = fork_choices(seqs, self.scheduler, self._requests, self._ids)
        plan = VerifyRows.of(seqs, [sampling_rows[r] for r in rows], drafted, draft_base)
        drafts = {g.first: g.draft for g in plan.groups if g.draft}
        samples, logprobs = self._draw(plan.seqs, logits[plan.logit_rows], plan.pending, drafts)
        results, result_rows = [], []
        for group in plan.groups:
            seq, first = group.seq, group.first
            accepted = accepted_count(samples[first : first + len(group.draft)], group.draft)
            for row in range(first, first + accepted + 1):
                reason = self.scheduler.append_token(seq, samples[row])
                results.append((seq, samples[row], reason))
                result_rows.append(row)
                if reason is not None:
                    break
            if group.draft:
                self.proposer.record(seq, len(group.draft), accepted)
                if not seq.is_finished:
                    self.scheduler.verified(seq, accepted)
        by_result = {i: logprobs[row] for i, row in enumerate(result_rows) if row in logprobs}
        return token_events(results, by_result, self._requests)

    def _launch_decodes(self, batch: ScheduledBatch, token_ids: torch.Tensor | None) -> torch.Tensor:
        """Async scheduling's device half: a decode-only step, sampled on the device."""
        self._copy_blocks(batch.block_copies)
        logits, _, _ = self.runner.forward(batch.decodes, [], decode_token_ids=token_ids)
        seqs = [c.seq for c in batch.decodes]
        # Fed from the device, each sequence's previous token is sampled but not appended yet.
        pending = 0 if token_ids is None else 1
        tensors = SamplingTensors.from_sequences(seqs, self.vocab_size, self.device, pending)
        return self.sampler(logits[:, : self.vocab_size], tensors)


def _salt(lora: str | None) -> bytes:
    """The prefix-cache salt of a text prompt run with adapter key `lora` (None: the base model)."""
    return lora.encode() if lora is not None else b""
