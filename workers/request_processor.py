"""One request end to end on the worker: prompt -> engine -> text chunks.

Runs on the worker's event loop, beside (never inside) the engine thread: templating,
tokenizing, detokenizing and stop-string search cost the engine no step time. When a
stop string matches, or the caller goes away, the request is aborted in the engine at
once and its KV blocks are freed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from workers.async_engine import AsyncEngine, EngineDeadError
from workers.detokenizer import IncrementalDetokenizer
from workers.engine import CapacityError, TokenEvent
from workers.prompts import PromptBuilder, PromptError
from workers.protocol import ErrorInfo, GenerateRequest, GenerationChunk
from workers.sampling_params import SamplingParams
from workers.sequence import FinishReason
from workers.stop_strings import StopStringMatcher

logger = logging.getLogger(__name__)


class RequestProcessor:
    def __init__(self, engine: AsyncEngine, tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer)
        self.max_model_len = engine.engine.limits.max_model_len

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        arrival = time.perf_counter()
        try:
            prompt_ids = self.prompts.token_ids(request)
            params = self._resolve_params(request, len(prompt_ids))
            stream = self.engine.add_request(prompt_ids, params)
        except PromptError as exc:
            yield GenerationChunk(error=ErrorInfo(400, str(exc), param=exc.param))
            return
        except CapacityError as exc:
            param = "max_tokens" if request.max_tokens is not None else "messages"
            yield GenerationChunk(error=ErrorInfo(400, str(exc), param=param, code="context_length_exceeded"))
            return
        except EngineDeadError as exc:
            yield GenerationChunk(error=ErrorInfo(503, str(exc), type="server_error", code="engine_dead"))
            return

        state = _OutputState(self.tokenizer, prompt_ids, params, arrival)
        try:
            async for events in stream:
                chunk = state.consume(events)
                yield chunk
                if chunk.finish_reason is not None:
                    return
        except EngineDeadError as exc:
            yield GenerationChunk(error=ErrorInfo(500, str(exc), type="server_error", code="engine_dead"))
        finally:
            # Stop string matched, client went away, or an error: free the sequence now.
            self.engine.abort(stream)

    def _resolve_params(self, request: GenerateRequest, num_prompt_tokens: int) -> SamplingParams:
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - num_prompt_tokens)
        return dataclasses.replace(request.params, max_tokens=max_tokens)


class _OutputState:
    """Detokenizer, stop matcher, counters and timings of one request."""

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams, arrival: float) -> None:
        self.params = params
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.last_time = arrival

    def consume(self, events: list[TokenEvent]) -> GenerationChunk:
        chunk = GenerationChunk(prompt_tokens=self.prompt_tokens)
        texts: list[str] = []
        for event in events:
            self._time(chunk, event.time)
            self.completion_tokens += 1
            chunk.token_ids.append(event.token_id)
            if self._shows_token(event):
                texts.append(self.stops.push(self.detok.push(event.token_id)))
            if self.stops.matched is not None:
                chunk.finish_reason, chunk.stop_reason = FinishReason.STOP.value, self.stops.matched
                break
            if event.finish_reason is not None:
                texts.append(self.stops.flush())
                chunk.finish_reason = event.finish_reason.value
                chunk.stop_reason = event.stop_token_id
                break
        chunk.text = "".join(texts)
        chunk.completion_tokens = self.completion_tokens
        return chunk

    def _shows_token(self, event: TokenEvent) -> bool:
        """The EOS or stop token that ends a request is not part of its text."""
        if event.finish_reason is not FinishReason.STOP:
            return True
        return event.stop_token_id is not None and self.params.include_stop_str_in_output

    def _time(self, chunk: GenerationChunk, when: float) -> None:
        elapsed_ms = (when - self.last_time) * 1000.0
        if self.completion_tokens == 0:
            chunk.prefill_time_ms = elapsed_ms
        else:
            chunk.decode_times_ms.append(elapsed_ms)
        self.last_time = when
