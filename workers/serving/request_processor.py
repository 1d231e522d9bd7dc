"""One request end to end on the worker: prompt -> engine -> text chunks.

Runs on the worker's event loop, beside (never inside) the engine thread: templating,
tokenizing, detokenizing and stop-string search cost the engine no step time. When a
stop string matches, or the caller goes away, the request is aborted in the engine at
once and its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from workers.contract.chunks import ErrorInfo, GenerationChunk, TokenLogprob, TopLogprob
from workers.contract.grammar import GuidedDecodingError
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams
from workers.engine.events import TokenEvent
from workers.engine.limits import CapacityError
from workers.engine.sequence import FinishReason
from workers.model.multimodal import ImageEncodeError
from workers.serving.async_engine import AsyncEngine, EngineDeadError
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.prompts import Prompt, PromptBuilder, PromptError
from workers.text.stop_strings import StopStringMatcher
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
        self.max_model_len = engine.engine.limits.max_model_len

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        arrival = time.perf_counter()
        try:
            prompt = await self._prompt(request)
            prompt_ids = prompt.token_ids
            params = self._resolve_params(request, len(prompt_ids))
            # Compiling a grammar can take milliseconds: neither the loop nor the engine waits.
            guide = await asyncio.to_thread(self.engine.engine.compile_guide, params) if params.guided else None
            stream = self.engine.add_request(prompt_ids, params, guide, images=prompt.images)
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

        reasoning_open = _opens_reasoning(prompt.text, request.reasoning_start)
        states = [_OutputState(self.tokenizer, prompt_ids, params, arrival, reasoning_open) for _ in range(params.n)]
        usage = _Usage(len(prompt_ids))
        batch_size = self.stream_interval * params.n
        pending: list[TokenEvent] = []  # events held back by the stream interval
        try:
            while not stream.finished:
                try:
                    arrived = await stream.next(self.timeouts.remaining(arrival, usage.completion_tokens > 0))
                except TimeoutError:
                    for chunk in self._chunks(pending, states, usage):
                        yield chunk
                    yield self._timeout_error(usage.completion_tokens > 0)
                    return
                pending += arrived
                if len(pending) < batch_size and not _must_send(arrived, stream.finished, usage):
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

    def _chunks(self, events: list[TokenEvent], states: list["_OutputState"], usage: "_Usage") -> list[GenerationChunk]:
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
            chunk = state.consume(by_choice[index], usage)
            chunk.index = index
            if chunk.prompt_logprobs is None and by_choice[index][0].prompt_logprobs is not None:
                chunk.prompt_logprobs = self._prompt_logprobs(by_choice[index][0].prompt_logprobs, state.prompt_ids)
            chunks.append(chunk)
        return chunks

    def _prompt_logprobs(self, scored, prompt_ids: list[int]) -> list[dict[int, TopLogprob] | None]:
        decode = self.tokenizer.decode
        out: list[dict[int, TopLogprob] | None] = [None]  # the first prompt token has no context
        for token_id, logprob, top in scored:
            entry = {tid: TopLogprob(decode([tid]), tid, lp) for tid, lp in top}
            entry[token_id] = TopLogprob(decode([token_id]), token_id, logprob)
            out.append(entry)
        return out

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


def _must_send(arrived: list[TokenEvent], finished: bool, usage: "_Usage") -> bool:
    """Events that go out at once whatever the stream interval: the first token (no timer
    on the time to first token), the request's end, and a failure."""
    return usage.completion_tokens == 0 or finished or any(e.error is not None for e in arrived)


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


@dataclass
class _Usage:
    prompt_tokens: int
    completion_tokens: int = 0  # all choices
    cached_tokens: int | None = None  # known once the request's first step ran


class _OutputState:
    """Detokenizer, stop matcher, timings and logprobs of one choice of a request."""

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams, arrival: float,
                 reasoning_open: bool = False) -> None:
        self.tokenizer = tokenizer
        self.reasoning_open = reasoning_open
        self.params = params
        self.prompt_ids = prompt_ids
        self.num_tokens = 0
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.last_time = arrival
        self.finished = False

    def consume(self, events: list[TokenEvent], usage: _Usage) -> GenerationChunk:
        chunk = GenerationChunk(prompt_tokens=usage.prompt_tokens, reasoning_open=self.reasoning_open)
        if self.params.logprobs is not None:
            chunk.logprobs = []
        texts: list[str] = []
        for event in events:
            if event.queue_time is not None:
                chunk.queue_time_ms = event.queue_time * 1000.0
            if event.cached_tokens is not None:
                usage.cached_tokens = event.cached_tokens
            chunk.cached_tokens = usage.cached_tokens
            if event.beam_token_ids is not None:
                return self._whole_beam(chunk, event, usage)
            self._time(chunk, event.time)
            self.num_tokens += 1
            usage.completion_tokens += 1
            chunk.token_ids.append(event.token_id)
            if self._shows_token(event):
                # Stop strings only count once min_tokens are out (as vLLM).
                armed = self.num_tokens >= self.params.min_tokens
                texts.append(self.stops.push(self.detok.push(event.token_id), armed))
            if chunk.logprobs is not None and event.logprob is not None:
                chunk.logprobs.append(self._token_logprob(event))
            if self.stops.matched is not None:
                chunk.finish_reason, chunk.stop_reason = FinishReason.STOP.value, self.stops.matched
                break
            if event.finish_reason is not None:
                texts.append(self.stops.flush())
                chunk.finish_reason = event.finish_reason.value
                chunk.stop_reason = event.stop_token_id
                break
        self.finished = chunk.finish_reason is not None
        chunk.text = "".join(texts)
        chunk.completion_tokens = usage.completion_tokens
        return chunk

    def _whole_beam(self, chunk: GenerationChunk, event: TokenEvent, usage: _Usage) -> GenerationChunk:
        """Beam search returns each finished beam at once: its text, cut at a stop string."""
        self._time(chunk, event.time)
        ids = event.beam_token_ids
        self.num_tokens = len(ids)
        usage.completion_tokens += len(ids)
        chunk.token_ids = list(ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        chunk.text = self.stops.push(text) + (self.stops.flush() if self.stops.matched is None else "")
        chunk.finish_reason = FinishReason.STOP.value if self.stops.matched else event.finish_reason.value
        chunk.stop_reason = self.stops.matched
        chunk.completion_tokens = usage.completion_tokens
        self.finished = True
        return chunk

    def _token_logprob(self, event: TokenEvent) -> TokenLogprob:
        decode = self.tokenizer.decode
        top = [TopLogprob(decode([tid]), tid, lp) for tid, lp in event.top_logprobs or []]
        return TokenLogprob(decode([event.token_id]), event.token_id, event.logprob, top)

    def _shows_token(self, event: TokenEvent) -> bool:
        """The EOS or stop token that ends a request is not part of its text."""
        if event.finish_reason is not FinishReason.STOP:
            return True
        return event.stop_token_id is not None and self.params.include_stop_str_in_output

    def _time(self, chunk: GenerationChunk, when: float) -> None:
        elapsed_ms = (when - self.last_time) * 1000.0
        if self.num_tokens == 0:
            chunk.prefill_time_ms = elapsed_ms
        else:
            chunk.decode_times_ms.append(elapsed_ms)
        self.last_time = when
