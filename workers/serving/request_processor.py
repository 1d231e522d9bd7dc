"""One request end to end on the worker: prompt -> engine -> text chunks.

Runs on the worker's event loop, beside (never inside) the engine thread: templating,
tokenizing, detokenizing and stop-string search cost the engine no step time. When a
stop string matches, or the caller goes away, the request is aborted in the engine at
once and its KV blocks are freed. A request that resumes a broken stream
(`GenerateRequest.resume`) first replays what its client has, then sends only new text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.continuation import Continuation
from workers.contract.grammar import GuidedDecodingError
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams
from workers.engine.events import TokenEvent
from workers.engine.limits import CapacityError
from workers.engine.resume import ContinuationError, ResumedChoice
from workers.model.multimodal import ImageEncodeError
from workers.sampling.guided import GuideState
from workers.serving.async_engine import AsyncEngine, EngineDeadError, RequestStream
from workers.serving.choice_output import ChoiceOutput, Usage
from workers.text.prompts import Prompt, PromptBuilder, PromptError
from workers.text.vision_prompts import VisionPromptBuilder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timeouts:
    first_token_s: float | None = None
    request_s: float | None = None

    def remaining(self, arrival: float, got_first_token: bool) -> float | None:
        """Seconds left before the nearer deadline; None when neither applies."""
        now = time.perf_counter()
        limits = [arrival + self.request_s - now] if self.request_s else []
        if self.first_token_s and not got_first_token:
            limits.append(arrival + self.first_token_s - now)
        return max(0.0, min(limits)) if limits else None


@dataclass
class _Start:
    """A request that got into the engine (or had nothing left to generate)."""

    states: list[ChoiceOutput]  # one per choice
    usage: Usage
    stream: RequestStream | None  # None: every choice was already finished
    done: list[GenerationChunk]  # last chunks of choices a continuation's ids end


class RequestProcessor:
    def __init__(self, engine: AsyncEngine, tokenizer, timeouts: Timeouts = Timeouts(),
                 vision: VisionPromptBuilder | None = None, stream_interval: int = 1) -> None:
        """`stream_interval`: after the first token, a chunk goes out once this many tokens
        per choice are waiting (or the request ends): fewer, larger messages through Serve's
        hops, at the price of a burstier stream (docs/BENCHMARKS.md, "stream interval")."""
        self.engine = engine
        self.timeouts = timeouts
        self.stream_interval = stream_interval
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer)
        self.vision = vision  # vision-language models only
        self.max_model_len = engine.limits.max_model_len

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        arrival = time.perf_counter()
        try:
            start = await self._start(request, arrival)
        except ContinuationError as exc:
            yield GenerationChunk(error=ErrorInfo(400, f"the request cannot be resumed: {exc}", param="resume",
                                                  code="invalid_continuation"))
            return
        except PromptError as exc:
            yield GenerationChunk(error=ErrorInfo(400, str(exc), param=exc.param, code=exc.code))
            return
        except GuidedDecodingError as exc:
            yield GenerationChunk(error=ErrorInfo(400, f"the output constraint cannot be used: {exc}",
                                                  param=request.params.guided.param if request.params.guided else None,
                                                  code="invalid_grammar"))
            return
        except CapacityError as exc:
            prompt_param = "prompt" if request.prompt is not None else "messages"
            param = "max_tokens" if request.max_tokens is not None and not exc.prompt_alone else prompt_param
            yield GenerationChunk(error=ErrorInfo(400, str(exc), param=param, code="context_length_exceeded"))
            return
        except EngineDeadError as exc:
            yield GenerationChunk(error=ErrorInfo(503, str(exc), type="server_error", code="engine_dead"))
            return

        for chunk in start.done:  # choices the given ids already end
            yield chunk
        if start.stream is None:
            return
        stream, states, usage = start.stream, start.states, start.usage
        resumed_tokens = usage.completion_tokens  # "the first token" is the first new one
        pending: list[TokenEvent] = []  # events held back by the stream interval
        try:
            while not stream.finished:
                got_token = usage.completion_tokens > resumed_tokens
                try:
                    arrived = await stream.next(self.timeouts.remaining(arrival, got_token))
                except TimeoutError:
                    for chunk in self._chunks(pending, states, usage):
                        yield chunk
                    yield self._timeout_error(got_token)
                    return
                pending += arrived
                batch_size = self.stream_interval * sum(not state.finished for state in states)  # per live choice
                if len(pending) < batch_size and not _must_send(arrived, stream.finished, got_token):
                    continue  # (events held before were checked when they arrived)
                events, pending = pending, []
                for chunk in self._chunks(events, states, usage):
                    yield chunk
                if all(state.finished for state in states):
                    return
        except EngineDeadError as exc:
            yield GenerationChunk(error=ErrorInfo(500, str(exc), type="server_error", code="engine_dead"))
        except ImageEncodeError as exc:
            yield GenerationChunk(error=ErrorInfo(500, str(exc), type="internal_error", code="engine_error"))
        finally:
            # Stop string matched, client went away, or an error: free the sequences now.
            self.engine.abort(stream)

    async def _start(self, request: GenerateRequest, arrival: float) -> _Start:
        """Template and tokenize, compile the grammar, replay a continuation, add to the engine."""
        prompt = await self._prompt(request)
        prompt_ids = prompt.token_ids
        params = self._resolve_params(request, len(prompt_ids))
        # Compiling a grammar can take milliseconds: neither the loop nor the engine waits.
        guide = await asyncio.to_thread(self.engine.compile_guide, params) if params.guided else None
        reasoning_open = _opens_reasoning(prompt.text, request.reasoning_start)
        states = [ChoiceOutput(self.tokenizer, prompt_ids, params, arrival, reasoning_open) for _ in range(params.n)]
        usage = Usage(len(prompt_ids))
        resume, done = None, []
        if request.resume is not None and not request.resume.is_empty:
            # Replaying the client's ids costs two short decodes a token: off the loop.
            resume, done = await asyncio.to_thread(self._resume, request.resume, prompt_ids, params, guide,
                                                   states, usage)
        if resume == []:
            return _Start(states, usage, None, done)  # the given ids end every choice
        stream = self.engine.add_request(prompt_ids, params, guide, images=prompt.images, resume=resume)
        return _Start(states, usage, stream, done)

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

    def _timeout_error(self, got_first_token: bool) -> GenerationChunk:
        if got_first_token:
            message, code = f"the request ran past its {self.timeouts.request_s} s limit", "request_timeout"
        else:
            limit = self.timeouts.first_token_s if self.timeouts.first_token_s else self.timeouts.request_s
            message, code = f"no token within the {limit} s limit", "first_token_timeout"
        return GenerationChunk(error=ErrorInfo(504, message, type="timeout_error", code=code))

    def _chunks(self, events: list[TokenEvent], states: list[ChoiceOutput], usage: Usage) -> list[GenerationChunk]:
        """One chunk per choice that has news in this batch of events, in choice order. A
        failure ends the request, after the tokens that came before it (a batch can hold
        both: held back by the stream interval, or queued while the loop was busy)."""
        failed = next((i for i, e in enumerate(events) if e.error is not None), None)
        if failed is not None:
            chunks = self._chunks(events[:failed], states, usage)
            for state in states:
                state.finished = True
            return chunks + [_step_error(events[failed])]
        by_choice: dict[int, list[TokenEvent]] = {}
        for event in events:
            by_choice.setdefault(event.index, []).append(event)
        chunks = []
        for index in sorted(by_choice):
            state = states[index]
            if state.finished:
                continue  # tokens sampled after a stop string matched, before the abort landed
            chunks.append(state.chunk(index, by_choice[index], usage))
        return chunks

    def _resume(self, continuation: Continuation, prompt_ids: list[int], params: SamplingParams,
                guide: GuideState | None, states: list[ChoiceOutput],
                usage: Usage) -> tuple[list[ResumedChoice] | None, list[GenerationChunk]]:
        """Prime each choice with what its client has. Returns the choices to go on with
        (None: run the request from the start, as beam search does) and the last chunks of
        those the given ids already end. Raises ContinuationError."""
        given = continuation.choices
        if len(given) != params.n:
            raise ContinuationError(f"{len(given)} choices given for a request of {params.n}")
        for state, progress in zip(states, given):
            if progress.finished:
                state.skip(progress.token_ids, usage)
        outputs = {i: list(c.token_ids) for i, c in enumerate(given) if not c.finished}
        if params.use_beam_search:
            # Beams come out whole at the end, so nothing partial was sent: run it again.
            if any(outputs.values()):
                raise ContinuationError("beam search resumes from the start: unfinished beams carry no tokens")
            return None, []
        replayed = self.engine.replay_output(prompt_ids, params, outputs, guide)
        done = [chunk for r in replayed
                if (chunk := states[r.index].replay(r.index, r.output_ids, r.finish_reason, r.stop_token_id, usage))]
        for chunk in done:
            chunk.completion_tokens = usage.completion_tokens
        return [r for r in replayed if not states[r.index].finished], done

    def _resolve_params(self, request: GenerateRequest, num_prompt_tokens: int) -> SamplingParams:
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - num_prompt_tokens)
        return dataclasses.replace(request.params, max_tokens=max_tokens)


INLINE_PROMPT_BYTES = 32 * 1024


def _prompt_size(request: GenerateRequest) -> int:
    """Characters of text in the request (roughly; enough to tell short from long)."""
    if request.prompt is not None:
        return len(request.prompt)
    return sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 256
               for m in request.messages or ())


def _must_send(arrived: list[TokenEvent], finished: bool, got_token: bool) -> bool:
    """Events that go out at once whatever the stream interval: the first (new) token (no
    timer on the time to first token, nor on a resumed stream's pause), the request's
    end, and a failure."""
    return not got_token or finished or any(e.error is not None for e in arrived)


def _step_error(failed: TokenEvent) -> GenerationChunk:
    if failed.error_is_grammar:
        # The request's own schema or grammar: it allowed a start it cannot finish.
        return GenerationChunk(error=ErrorInfo(
            400, f"the output constraint reached a point no token can continue ({failed.error})",
            code="invalid_grammar"))
    return GenerationChunk(error=ErrorInfo(500, f"this request failed inside the engine ({failed.error})",
                                           type="internal_error", code="engine_error"))


def _opens_reasoning(prompt_text: str | None, start_tag: str | None) -> bool:
    """A template that ends the generation prompt with the reasoning tag (e.g. `<think>\n`)
    makes the output start inside the reasoning; only the rendered prompt shows it."""
    return bool(prompt_text and start_tag and prompt_text.rstrip().endswith(start_tag))
