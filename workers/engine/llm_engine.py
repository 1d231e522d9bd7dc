"""The synchronous engine: add requests, run steps, abort. One model step per `step()`.

Everything here runs on one thread (the engine thread in production, the test thread
in unit tests); async_engine.py puts it behind asyncio streams.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from workers.contract.grammar import GuidedDecodingError
from workers.contract.sampling_params import SamplingParams
from workers.engine.batch import PromptLogitRows
from workers.engine.beam_search import BeamGroup
from workers.engine.block_manager import BlockManager
from workers.engine.events import TokenEvent
from workers.engine.limits import CapacityError, EngineLimits
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import FinishReason, Sequence
from workers.model.cuda_graphs import DecodeGraphs
from workers.model.kv_cache import KVCacheShape, PagedKVCache
from workers.model.multimodal import ImageInputs
from workers.model.runner import ModelRunner
from workers.model.triton_attention import triton_available
from workers.sampling.guided import GuidedDecoder, GuideState
from workers.sampling.logprobs import token_logprobs
from workers.sampling.sampler import Sampler, SamplingTensors

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: frozenset[int],
        limits: EngineLimits,
        device: torch.device,
        tokenizer=None,
    ) -> None:
        """`tokenizer` (a fast HF tokenizer) enables guided decoding; without one, a guided
        request is refused."""
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
        triton_decode = device.type == "cuda" and triton_available()
        use_graphs = device.type == "cuda" and limits.cuda_graph_max_batch > 0
        if use_graphs and not triton_decode:
            logger.warning("CUDA graphs need the Triton decode kernel (triton not importable): decode runs eager")
            use_graphs = False
        self.kv_cache = PagedKVCache(shape, num_blocks, limits.block_size, device, padding_block=use_graphs)
        self.blocks = BlockManager(num_blocks, limits.block_size, limits.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(limits.max_num_seqs, limits.max_num_batched_tokens,
                            limits.max_prefill_tokens_while_decoding), self.blocks
        )
        self.runner = ModelRunner(model, self.kv_cache, device, triton_decode=triton_decode)
        if use_graphs:
            graphs = DecodeGraphs(model, self.kv_cache, min(limits.cuda_graph_max_batch, limits.max_num_seqs),
                                  limits.max_model_len, self.vocab_size)
            graphs.capture()
            self.runner.decode_graphs = graphs
        self.sampler = Sampler()
        self.guided = _guided_decoder(tokenizer, self.vocab_size, eos_token_ids)
        self._ids = itertools.count()
        self._requests: dict[int, list[Sequence]] = {}  # request id -> its live choices
        self._beams: dict[int, BeamGroup] = {}  # beam-search requests
        self._pending_beam_rows: dict[int, torch.Tensor] = {}  # seq id -> logprobs, until siblings catch up
        self._suspects: list[int] = []  # requests of a failed step, re-run one at a time
        self._in_flight: _InFlight | None = None  # async scheduling: a launched step not read back yet
        self.async_steps = 0  # steps launched from a previous step's tokens still on the device

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise CapacityError if the request can never run here. Reads only fixed limits,
        so any thread may call it."""
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
            raise GuidedDecodingError("guided decoding is not available with beam search")
        if self.guided is None:
            raise GuidedDecodingError("this engine has no tokenizer, so it cannot guide decoding")
        return self.guided.compile(params.guided)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, guide: GuideState | None = None, *,
                    images: ImageInputs | None = None) -> int:
        """Queue a request; returns its id. Choices 1..n-1 fork from choice 0 after the prompt.
        A guided request's grammar is compiled here unless `guide` (from compile_guide) is given.
        A request's images are encoded here, once (raises ImageEncodeError)."""
        self.check_request(prompt_token_ids, params)
        if params.guided is not None and guide is None:
            guide = self.compile_guide(params)
        seq = Sequence(
            seq_id=next(self._ids),
            token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.limits.max_model_len,
            cache_salt=images.salt if images is not None else b"",
            image_features=self.runner.encode_images(images) if images is not None else None,
            guide=guide,
        )
        self._requests[seq.request_id] = [seq]
        if params.use_beam_search:
            ends = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
            self._beams[seq.request_id] = BeamGroup(params.beam_width, params.n, params.length_penalty, ends)
        self.scheduler.add(seq)
        return seq.request_id

    def abort_request(self, request_id: int) -> None:
        self._beams.pop(request_id, None)
        for seq in self._requests.pop(request_id, []):
            self._pending_beam_rows.pop(seq.seq_id, None)
            self.scheduler.abort(seq)

    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work()

    @property
    def num_active(self) -> int:
        return len(self._requests)

    def step(self) -> list[TokenEvent]:
        """One model step. If it raises, the step is undone and its requests are re-run one
        at a time, so only the request that makes a step fail is failed."""
        if self._in_flight is not None:
            return self._step_async()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        snapshot = _StepSnapshot.take(batch, self._requests, self._pending_beam_rows)
        try:
            events = self._execute(batch)
        except Exception as exc:  # noqa: BLE001 - contained to the request(s) of this step
            return self._contain(batch, snapshot, exc)
        if self.scheduler.only_request is not None:
            self._next_suspect()  # the suspect stepped cleanly
        return events

    def _contain(self, batch, snapshot: "_StepSnapshot", exc: Exception) -> list[TokenEvent]:
        request_ids = snapshot.request_ids
        if len(request_ids) > 1 and snapshot.restore(self):
            self._suspects = [r for r in request_ids if r in self._requests]
            self.scheduler.only_request = self._suspects[0]
            return []
        # Alone (or not restorable): these requests fail; everyone else goes on.
        logger.exception("model step failed for request(s) %s", request_ids)
        now = time.perf_counter()
        events = []
        for request_id in request_ids:
            if request_id in self._requests:
                self.abort_request(request_id)
                events.append(TokenEvent(request_id, 0, -1, FinishReason.ABORT, None, now,
                                         request_finished=True, error=f"{type(exc).__name__}: {exc}",
                                         error_is_grammar=isinstance(exc, GuidedDecodingError)))
        if self.scheduler.only_request is not None:
            self._next_suspect()
        return events

    def _next_suspect(self) -> None:
        self._suspects = [r for r in self._suspects[1:] if r in self._requests]
        self.scheduler.only_request = self._suspects[0] if self._suspects else None

    def _execute(self, batch) -> list[TokenEvent]:
        self.kv_cache.copy_blocks(batch.block_copies)
        if self._can_run_async(batch):
            self._in_flight = self._launch(batch)
            return []  # its tokens come out of the next step() call
        logits, prompt_rows = self.runner.forward(batch.decodes, batch.prefills)
        logits = logits[:, : self.vocab_size]
        chunks = batch.sampling_chunks
        self.scheduler.advance(batch)
        self._score_prompts(logits[len(chunks) :], prompt_rows)
        beam_rows = [i for i, c in enumerate(chunks) if c.seq.params.use_beam_search]
        events = self._beam_step([chunks[i].seq for i in beam_rows], logits[beam_rows]) if beam_rows else []
        sampling = [c.seq for c in chunks if not c.seq.params.use_beam_search]
        seqs, rows = self._sampling_rows(sampling)
        if not seqs:
            return events
        row_logits = _rows_of(logits, [i for i, c in enumerate(chunks) if not c.seq.params.use_beam_search], rows)
        tensors = SamplingTensors.from_sequences(seqs, self.vocab_size, self.device)
        if self.guided is not None:
            tensors.guided = self.guided.mask([s.guide for s in seqs], self.device)
        tokens = self.sampler(row_logits, tensors)
        logprobs = self._logprobs(seqs, row_logits, tokens)
        results = self.scheduler.append_tokens(seqs, tokens.tolist())
        return events + self._events(results, logprobs)

    # --- async scheduling -----------------------------------------------------------
    # On a GPU the host's share of a decode step (schedule, inputs, events: ~1.3 ms on an
    # H100 box) otherwise sits between the device's steps. With async scheduling a plain
    # decode step is launched, and the next one is launched from its sampled ids while they
    # are still on the device; only then are the first step's ids read back and turned
    # into events. A sequence that stops (EOS, stop token) runs one wasted row in the step
    # launched behind it; its output is unchanged. A finish by length is known ahead.

    def _can_run_async(self, batch) -> bool:
        return (self.limits.async_scheduling and bool(batch.decodes) and not batch.prefills
                and self.scheduler.only_request is None and all(_async_ok(c.seq) for c in batch.decodes))

    def _launch(self, batch, token_ids: torch.Tensor | None = None) -> "_InFlight":
        """Run a decode-only step and sample on the device; the ids come back asynchronously.
        The step counts as computed only once everything is launched, so a failure leaves
        the sequences as they were."""
        seqs = [c.seq for c in batch.decodes]
        logits, _ = self.runner.forward(batch.decodes, [], decode_token_ids=token_ids)
        tokens = self.sampler(logits[:, : self.vocab_size], SamplingTensors.from_sequences(seqs, self.vocab_size,
                                                                                           self.device))
        flight = _InFlight.start(seqs, tokens)
        self.scheduler.advance(batch)
        return flight

    def _step_async(self) -> list[TokenEvent]:
        flight, self._in_flight = self._in_flight, None
        self._in_flight = self._launch_next(flight)
        return self._complete(flight)

    def _launch_next(self, flight: "_InFlight") -> "_InFlight | None":
        """The next decode step, fed by `flight`'s ids on the device; None: drain instead."""
        batch = self.scheduler.continue_decodes(flight.seqs)
        if batch is None:
            return None
        row_of = {id(s): i for i, s in enumerate(flight.seqs)}
        keep = [row_of[id(c.seq)] for c in batch.decodes]
        token_ids = flight.tokens if len(keep) == len(flight.seqs) else flight.tokens[
            torch.tensor(keep, device=flight.tokens.device)]
        try:
            self.kv_cache.copy_blocks(batch.block_copies)
            launched = self._launch(batch, token_ids)
        except Exception:  # noqa: BLE001 - drain; the next (synchronous) step contains a failure
            logger.exception("async decode step failed to launch; running the next step synchronously")
            return None
        self.async_steps += 1
        return launched

    def _complete(self, flight: "_InFlight") -> list[TokenEvent]:
        """Read a launched step's ids back and emit them; rows of sequences that ended
        (or were aborted) meanwhile are dropped."""
        sampled = flight.wait()
        live = [(s, t) for s, t in zip(flight.seqs, sampled) if not s.is_finished]
        results = self.scheduler.append_tokens([s for s, _ in live], [t for _, t in live])
        for seq, _ in live:
            if not seq.is_finished:  # blocks whose last token just became known
                self.blocks.cache_computed_blocks(seq)
        return self._events(results, {})

    # --- beam search --------------------------------------------------------------

    def _beam_step(self, seqs: list[Sequence], logits: torch.Tensor) -> list[TokenEvent]:
        """Park each beam's log-probabilities; advance every request whose live beams all have theirs."""
        for seq, row in zip(seqs, torch.log_softmax(logits, dim=-1)):
            self._pending_beam_rows[seq.seq_id] = row
        events: list[TokenEvent] = []
        for request_id in dict.fromkeys(s.request_id for s in seqs):
            live = self._requests.get(request_id, [])
            if live and all(s.seq_id in self._pending_beam_rows for s in live):
                rows = torch.stack([self._pending_beam_rows.pop(s.seq_id) for s in live])
                events.extend(self._advance_beams(request_id, live, rows))
        return events

    def _advance_beams(self, request_id: int, live: list[Sequence], rows: torch.Tensor) -> list[TokenEvent]:
        group = self._beams[request_id]
        chosen = group.step(rows, [s.cum_logprob for s in live], [s.output_token_ids for s in live])
        targets: list[tuple[Sequence, int, float]] = []
        used: set[int] = set()
        for cont in chosen:  # fork first: a child copies its parent before the parent appends
            parent = live[cont.beam]
            if cont.beam in used:
                child = parent.fork(next(self._ids), parent.index)
                self.scheduler.fork(parent, [child])
                targets.append((child, cont.token_id, cont.cum_logprob))
            else:
                used.add(cont.beam)
                targets.append((parent, cont.token_id, cont.cum_logprob))
        for beam, seq in enumerate(live):
            if beam not in used:
                self.scheduler.drop(seq)
        next_live = []
        for seq, token, cum in targets:
            seq.cum_logprob = cum
            if seq.append_token(token) is FinishReason.LENGTH:
                group.finish_live([(seq.output_token_ids, cum)], "length")
                self.scheduler.running.remove(seq)
                self.scheduler.finish(seq, FinishReason.LENGTH)
            else:
                next_live.append(seq)
        self._requests[request_id] = next_live
        if not group.is_done([(s.cum_logprob, s.num_output_tokens) for s in next_live]):
            return []
        return self._finish_beams(request_id, group, live[0].num_cached_tokens)

    def _finish_beams(self, request_id: int, group: BeamGroup, cached_tokens: int | None) -> list[TokenEvent]:
        self.abort_request(request_id)  # drops the beams still live and the group
        now = time.perf_counter()
        best = group.best()
        return [
            TokenEvent(
                request_id=request_id,
                index=i,
                token_id=-1,
                finish_reason=FinishReason(h.finish_reason),
                stop_token_id=None,
                time=now,
                logprob=h.cum_logprob,
                beam_token_ids=h.token_ids,
                request_finished=i == len(best) - 1,
                cached_tokens=cached_tokens if i == 0 else None,
            )
            for i, h in enumerate(best)
        ]

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
            first_token = seq.num_output_tokens == 1 and seq.index == 0
            first = first_token and seq.params.prompt_logprobs is not None
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
                    request_finished=reason is not None and seq.request_id not in self._requests,
                    queue_time=seq.queue_time if first_token else None,
                    cached_tokens=seq.num_cached_tokens if first_token else None,
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


@dataclass
class _InFlight:
    """A decode step launched on the device whose sampled ids are not on the host yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] sampled ids, on the device
    host: torch.Tensor  # [n] their copy on the host (pinned on CUDA), filled asynchronously
    ready: torch.cuda.Event | None  # recorded after that copy (CUDA)

    @classmethod
    def start(cls, seqs: list[Sequence], tokens: torch.Tensor) -> "_InFlight":
        if tokens.device.type != "cuda":
            return cls(seqs, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(seqs, tokens, host, ready)

    def wait(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # this step's copy only, not the step launched behind it
        return self.host.tolist()


def _async_ok(seq: Sequence) -> bool:
    """A sequence whose next sampling reads nothing of its latest token on the host: no
    grammar, penalties, logprobs or beams, and past its min_tokens bans."""
    params = seq.params
    return (seq.guide is None and not params.has_penalties and params.logprobs is None
            and not params.use_beam_search and seq.num_output_tokens >= params.min_tokens)


def _rows_of(logits: torch.Tensor, sampling_rows: list[int], rows: list[int]) -> torch.Tensor:
    """The logits row of each sampled sequence: `rows` index into `sampling_rows` (the
    chunks that sample), which index into `logits`. In the common step (no beams, no
    forks) that is the first len(rows) rows in order: a view, not a copy of [S, V]."""
    index = [sampling_rows[r] for r in rows]
    if index == list(range(len(index))):
        return logits[: len(index)]
    return logits[index]


def _guided_decoder(tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> GuidedDecoder | None:
    if tokenizer is None:
        return None
    try:
        return GuidedDecoder(tokenizer, vocab_size, eos_token_ids)
    except ValueError:  # llguidance reads fast (Rust) tokenizers only
        logger.warning("guided decoding is off: %s is not a fast tokenizer", type(tokenizer).__name__)
        return None


@dataclass
class _StepSnapshot:
    """What a step may change, so a failed step can be undone before it is retried."""

    request_ids: list[int]
    seqs: list[tuple[Sequence, int, int, float]]  # (seq, num_computed, num_tokens, cum_logprob)
    groups: dict[int, list[Sequence]]
    pending_beam_rows: dict[int, torch.Tensor]

    @classmethod
    def take(cls, batch, requests: dict[int, list[Sequence]], pending: dict[int, torch.Tensor]) -> "_StepSnapshot":
        seqs = [c.seq for c in batch.decodes + batch.prefills]
        request_ids = list(dict.fromkeys(s.request_id for s in seqs))
        return cls(
            request_ids=request_ids,
            seqs=[(s, s.num_computed_tokens, s.num_tokens, s.cum_logprob) for s in seqs],
            groups={r: list(requests.get(r, [])) for r in request_ids},
            pending_beam_rows=dict(pending),
        )

    def restore(self, engine: "LLMEngine") -> bool:
        """Undo the step; False when a sequence already finished (its events would be lost)."""
        if any(seq.is_finished for seq, *_ in self.seqs):
            return False
        for request_id, before in self.groups.items():
            known = {id(s) for s in before}
            for seq in engine._requests.get(request_id, []):
                if id(seq) not in known:  # forked during the failed step
                    engine.scheduler.drop(seq)
            engine._requests[request_id] = before
        for seq, computed, length, cum in self.seqs:
            # Blocks the failed step registered in the prefix cache stay: they were only
            # registered after the forward pass wrote them, so their K/V are right.
            seq.num_computed_tokens = computed
            seq.truncate(length, engine.blocks.block_size)
            seq.cum_logprob = cum
            if seq.guide is not None:
                seq.guide.truncate(seq.output_token_ids)
        engine._pending_beam_rows.clear()
        engine._pending_beam_rows.update(self.pending_beam_rows)
        return True
