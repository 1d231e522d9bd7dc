"""One request end to end on the worker: prompt -> engine -> chunks in an outbox.

Runs on the worker's event loop, beside (never inside) the engine thread: templating,
tokenizing, detokenizing and stop-string search cost the engine no step time. Admission
(template, window and KV checks, grammar) happens here; from then on the request's
chunks are made by its `ActiveRequest` as each step's events arrive. When a stop string
matches, or the caller goes away, the request is aborted in the engine at once and its
KV blocks are freed. A request that resumes a broken stream (`GenerateRequest.resume`)
first replays what its client has, then sends only new text. Prefill/decode
disaggregation (workers/serving/kv_handoffs.py): a prefill replica's request ends once
each choice has its first token, with a hand-over chunk; a decode replica's takes the
hand-over's KV blocks into its cache before it is queued. A traced request's chunks pass
through its `TracedRequest` (workers/serving/request_trace.py), which writes its spans at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.continuation import Continuation
from workers.contract.errors import WorkerError
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams
from workers.engine.resume import ContinuationError, ResumedChoice
from workers.sampling.guided import GuideState
from workers.serving.active_request import ActiveRequest, Timeouts
from workers.serving.async_engine import AsyncEngine
from workers.serving.choice_output import ChoiceOutput, Usage
from workers.serving.kv_handoffs import KVHandoffs
from workers.serving.outbox import ChunkOutbox
from workers.serving.request_trace import TracedRequest, WorkerTracing
from workers.text.prompts import Prompt, PromptBuilder
from workers.text.vision_prompts import VisionPromptBuilder

logger = logging.getLogger(__name__)

__all__ = ["RequestProcessor", "Timeouts"]


class RequestProcessor:
    def __init__(self, engine: AsyncEngine, tokenizer, timeouts: Timeouts = Timeouts(),
                 vision: VisionPromptBuilder | None = None, stream_interval: int = 1,
                 default_max_tokens: int | None = None, handoffs: KVHandoffs | None = None,
                 tracing: WorkerTracing | None = None) -> None:
        """`stream_interval`: after the first token, a chunk goes out once this many tokens
        per choice are waiting (or the request ends): fewer, larger messages, at the price
        of a burstier stream. `default_max_tokens`: the output cap of a request that names
        none (None: the rest of the window). `tracing`: spans of traced requests
        (workers/serving/request_trace.py); None: tracing is not configured."""
        self.engine = engine
        self.default_max_tokens = default_max_tokens
        self.timeouts = timeouts
        self.stream_interval = stream_interval
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer)
        self.vision = vision  # vision-language models only
        self.max_model_len = engine.limits.max_model_len
        self.handoffs = handoffs or KVHandoffs(engine)
        self.tracing = tracing

    async def stream(self, request: GenerateRequest) -> AsyncIterator[list[GenerationChunk]]:
        """The request's chunks, everything pending at each wake-up as one list (one message)."""
        outbox = ChunkOutbox()
        task = asyncio.create_task(self._run_then_close(request, outbox))
        try:
            async for batch in outbox.batches():
                yield [chunk for _, chunk in batch]
        finally:
            task.cancel()  # the caller left early: the request is aborted and freed

    async def _run_then_close(self, request: GenerateRequest, outbox: ChunkOutbox) -> None:
        try:
            await self.run_guarded(request, outbox)
        finally:
            outbox.close()

    async def run_guarded(self, request: GenerateRequest, outbox: ChunkOutbox) -> None:
        """`run`, with a failure of this request's own path ending it with a 500 chunk."""
        try:
            await self.run(request, outbox)
        except Exception as exc:  # noqa: BLE001 - a bug in this request's path ends it, with a reason
            logger.exception("request %s failed on the worker", request.request_id)
            outbox.put(request.request_id, GenerationChunk(error=ErrorInfo(
                500, f"the request failed on the worker ({type(exc).__name__})", type="internal_error",
                code="engine_error")))

    async def run(self, request: GenerateRequest, outbox: ChunkOutbox) -> None:
        """The request from admission to its end, its chunks put in `outbox` under its
        request id; cancelling this coroutine aborts the request."""
        arrival = time.perf_counter()
        trace = None if self.tracing is None else self.tracing.begin(request, outbox, arrival)
        if trace is None:
            return await self._run(request, outbox, arrival)
        with trace:  # its chunks pass through the trace; leaving it writes the request's spans
            await self._run(request, trace, arrival, trace)

    async def _run(self, request: GenerateRequest, outbox: ChunkOutbox, arrival: float,
                   trace: TracedRequest | None = None) -> None:
        active = await self.admit(request, outbox, arrival)
        if trace is not None:
            trace.admitted()
        if active is None:
            return
        try:
            await active.until_done(self.timeouts, arrival)
        finally:
            active.close()
        if active.handed_off:
            lora = request.lora.key if request.lora is not None else None
            handoff = await self.handoffs.hand_off(active.prompt_ids, lora, active.usage.cached_tokens)
            outbox.put(request.request_id, GenerationChunk(handoff=handoff))

    async def admit(self, request: GenerateRequest, outbox: ChunkOutbox, arrival: float) -> ActiveRequest | None:
        """Template, check, replay a continuation, queue the request; None when refused or
        already finished (its chunks are in `outbox`). `arrival` (perf_counter) starts the
        request's timings."""
        try:
            prompt = await self._prompt(request)
            prompt_ids = prompt.token_ids
            params = self._resolve_params(request, len(prompt_ids))
            # Compiling a grammar can take milliseconds: neither the loop nor the engine waits.
            guide = await asyncio.to_thread(self.engine.compile_guide, params) if params.guided else None
            reasoning_open = _opens_reasoning(prompt.text, request.reasoning_start)
            choices = [ChoiceOutput(self.tokenizer, prompt_ids, params, arrival, reasoning_open)
                       for _ in range(params.n)]
            usage = Usage(len(prompt_ids))
            if request.kv_handoff is not None:  # the prefill replica's cache hits are the client's
                usage.cached_tokens, usage.cached_tokens_given = request.kv_handoff.cached_tokens, True
            resume, done = None, []
            if request.resume is not None and not request.resume.is_empty:
                # Replaying the client's ids costs two short decodes a token: off the loop.
                resume, done = await asyncio.to_thread(self._resume, request.resume, prompt_ids, params, guide,
                                                       choices, usage)
            lora = request.lora.key if request.lora is not None else None
            if request.kv_handoff is not None and resume:
                await self.handoffs.receive(request.kv_handoff, prompt_ids, lora)
            stream = None if resume == [] else self.engine.add_request(prompt_ids, params, guide, images=prompt.images,
                                                                      resume=resume, lora=lora)
        except WorkerError as exc:
            outbox.put(request.request_id, _refusal(request, exc))
            return None
        for chunk in done:  # choices the given ids already end
            outbox.put(request.request_id, chunk)
        if stream is None:
            return None  # the given ids end every choice
        return ActiveRequest(request.request_id, self.engine, stream, choices, usage, outbox, self.stream_interval,
                             prefill_only=request.prefill_only and not params.use_beam_search)

    async def _prompt(self, request: GenerateRequest) -> Prompt:
        if self.vision is None:
            if _prompt_size(request) > INLINE_PROMPT_BYTES:
                # A long conversation takes up to seconds to template and tokenize: in a
                # thread, the event loop keeps streaming other requests' tokens meanwhile.
                return await asyncio.to_thread(self.prompts.build, request)
            return self.prompts.build(request)  # short: a thread hop would cost more
        if not request.images:
            return self.vision.build(request)
        # Decoding and preparing pixels takes milliseconds per image: off the event loop,
        # which meanwhile streams other requests' tokens.
        return await asyncio.to_thread(self.vision.build, request)

    def _resume(self, continuation: Continuation, prompt_ids: list[int], params: SamplingParams,
                guide: GuideState | None, choices: list[ChoiceOutput],
                usage: Usage) -> tuple[list[ResumedChoice] | None, list[GenerationChunk]]:
        """Prime each choice with what its client has. Returns the choices to go on with
        (None: run the request from the start, as beam search does) and the last chunks of
        those the given ids already end. Raises ContinuationError."""
        given = continuation.choices
        if len(given) != params.n:
            raise ContinuationError(f"{len(given)} choices given for a request of {params.n}")
        for choice, progress in zip(choices, given):
            if progress.finished:
                choice.skip(progress.token_ids, usage)
        outputs = {i: list(c.token_ids) for i, c in enumerate(given) if not c.finished}
        if params.use_beam_search:
            # Beams come out whole at the end, so nothing partial was sent: run it again.
            if any(outputs.values()):
                raise ContinuationError("beam search resumes from the start: unfinished beams carry no tokens")
            return None, []
        replayed = self.engine.replay_output(prompt_ids, params, outputs, guide)
        done = [chunk for r in replayed
                if (chunk := choices[r.index].replay(r.index, r.output_ids, r.finish_reason, r.stop_token_id, usage))]
        for chunk in done:
            chunk.completion_tokens = usage.completion_tokens
        return [r for r in replayed if not choices[r.index].finished], done

    def _resolve_params(self, request: GenerateRequest, num_prompt_tokens: int) -> SamplingParams:
        max_tokens = request.max_tokens
        if max_tokens is None:  # the model's default cap, within what the window leaves
            room = max(1, self.max_model_len - num_prompt_tokens)
            max_tokens = room if self.default_max_tokens is None else min(self.default_max_tokens, room)
        params = dataclasses.replace(request.params, max_tokens=max_tokens)
        budget = params.thinking_budget
        if budget is not None:  # the tags as this tokenizer writes them
            budget = dataclasses.replace(budget, start_ids=self._tag_ids(budget.start), end_ids=self._tag_ids(budget.end))
            params = dataclasses.replace(params, thinking_budget=budget)
        return params

    def _tag_ids(self, tag: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(tag, add_special_tokens=False))


INLINE_PROMPT_BYTES = 32 * 1024


def _prompt_size(request: GenerateRequest) -> int:
    """Characters of text in the request (roughly; enough to tell short from long)."""
    if request.prompt is not None:
        return len(request.prompt)
    if request.prompt_token_ids is not None:
        return 4 * len(request.prompt_token_ids)  # about 4 characters a token
    return sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 256
               for m in request.messages or ())


def _refusal(request: GenerateRequest, exc: WorkerError) -> GenerationChunk:
    """The error chunk of a request refused at admission, its field named in the request's
    own terms: the prompt is `prompt` or `messages`, and an output budget the client did
    not set is not its fault (the prompt's length is)."""
    param = exc.param
    if param == "prompt" or (param == "max_tokens" and request.max_tokens is None):
        param = "messages" if request.messages is not None else "prompt"
    return GenerationChunk(error=exc.info(param))


def _opens_reasoning(prompt_text: str | None, start_tag: str | None) -> bool:
    """A template that ends the generation prompt with the reasoning tag (e.g. `<think>\n`)
    makes the output start inside the reasoning; only the rendered prompt shows it."""
    return bool(prompt_text and start_tag and prompt_text.rstrip().endswith(start_tag))
