"""One admitted request on the worker: each step's events become its chunks, in the outbox.

The engine thread hands a whole step's events to the event loop in one callback
(workers/serving/async_engine.py); every request of the step turns its events into
chunks right there (`on_events`), with no task switch per request, and puts them in its
outbox. The request's own coroutine only waits for the end (or a timeout).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.errors import WorkerError
from workers.core.events import TokenEvent
from workers.serving.async_engine import AsyncEngine, RequestStream
from workers.serving.choice_output import ChoiceOutput, Usage
from workers.serving.outbox import ChunkOutbox


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

    def error(self, got_first_token: bool) -> GenerationChunk:
        if got_first_token:
            message, code = f"the request ran past its {self.request_s} s limit", "request_timeout"
        else:
            limit = self.first_token_s if self.first_token_s else self.request_s
            message, code = f"no token within the {limit} s limit", "first_token_timeout"
        return GenerationChunk(error=ErrorInfo(504, message, type="timeout_error", code=code))


class ActiveRequest:
    def __init__(self, request_id: str, engine: AsyncEngine, stream: RequestStream, choices: list[ChoiceOutput],
                 usage: Usage, outbox: ChunkOutbox, stream_interval: int = 1, prefill_only: bool = False) -> None:
        """`stream_interval`: after the first token, a chunk goes out once this many tokens
        per choice are waiting (or the request ends). `prefill_only` (a prefill replica's
        request): done once every choice has its first token (`handed_off` then says some
        choice goes on, on a decode replica)."""
        self.request_id = request_id
        self.usage = usage
        self._engine = engine
        self._stream = stream
        self._choices = choices
        self._outbox = outbox
        self._stream_interval = stream_interval
        self._resumed_tokens = usage.completion_tokens  # a resumed request's first token is its first new one
        self._held: list[TokenEvent] = []  # events held back by the stream interval
        self._prefill_only = prefill_only
        self.handed_off = False
        self._done = asyncio.Event()
        stream.sink = self.on_events

    @property
    def prompt_ids(self) -> list[int]:
        return self._choices[0].prompt_ids

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def on_events(self, items: list[TokenEvent | BaseException]) -> None:
        """A step's events of this request (or the exception that failed it); runs on the loop."""
        if self.done:
            return  # tokens sampled after a stop string matched, before the abort landed
        try:
            self._on_events(items)
        except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer failure: this request only
            self._fail(_exception_error(exc))
            raise

    def _on_events(self, items: list[TokenEvent | BaseException]) -> None:
        failure = next((i for i in items if isinstance(i, BaseException)), None)
        arrived = [i for i in items if not isinstance(i, BaseException)]
        self._stream.finished = any(e.request_finished for e in arrived)
        self._held += arrived
        if failure is not None:
            self._put(self._take_chunks())
            self._fail(_exception_error(failure))
            return
        live = sum(not choice.finished for choice in self._choices)
        if len(self._held) < self._stream_interval * live and not self._must_send(arrived):
            return
        self._put(self._take_chunks())
        if all(choice.finished for choice in self._choices):
            self._end()
        elif self._prefill_only and all(choice.finished or choice.num_tokens for choice in self._choices):
            self.handed_off = True  # the first tokens are out: the rest is a decode replica's
            self._end()

    async def until_done(self, timeouts: Timeouts, arrival: float) -> None:
        """Wait for the end; past a deadline, end the request with a 504 chunk."""
        while not self.done:
            remaining = timeouts.remaining(arrival, self._got_token)
            try:
                await asyncio.wait_for(self._done.wait(), remaining)
            except TimeoutError:
                if not self.done and timeouts.remaining(arrival, self._got_token) == 0.0:
                    self._put(self._take_chunks())
                    self._fail(timeouts.error(self._got_token))

    def close(self) -> None:
        """The request's coroutine is leaving (ended, or cancelled): free its sequence now."""
        if not self.done:
            self._done.set()
            self._outbox.drop(self.request_id)
        self._engine.abort(self._stream)

    @property
    def _got_token(self) -> bool:
        return self.usage.completion_tokens > self._resumed_tokens

    def _must_send(self, arrived: list[TokenEvent]) -> bool:
        """Events that go out at once whatever the stream interval: the first (new) token (no
        timer on the time to first token, nor on a resumed stream's pause; a prefill
        replica's every token), the request's end, and a failure."""
        return (not self._got_token or self._prefill_only or self._stream.finished
                or any(e.error is not None for e in arrived))

    def _take_chunks(self) -> list[GenerationChunk]:
        """One chunk per choice that has news in the held events, in choice order. A failed
        step ends the request, after the tokens that came before it."""
        events, self._held = self._held, []
        failed = next((i for i, e in enumerate(events) if e.error is not None), None)
        if failed is not None:
            return self._choice_chunks(events[:failed]) + [_step_error(events[failed])]
        return self._choice_chunks(events)

    def _choice_chunks(self, events: list[TokenEvent]) -> list[GenerationChunk]:
        by_choice: dict[int, list[TokenEvent]] = {}
        for event in events:
            by_choice.setdefault(event.index, []).append(event)
        return [self._choices[i].chunk(i, by_choice[i], self.usage) for i in sorted(by_choice)
                if not self._choices[i].finished]

    def _put(self, chunks: list[GenerationChunk]) -> None:
        for chunk in chunks:
            self._outbox.put(self.request_id, chunk)
        if any(chunk.error is not None for chunk in chunks):
            self._end()

    def _fail(self, error: GenerationChunk) -> None:
        if not self.done:
            self._outbox.put(self.request_id, error)
            self._end()

    def _end(self) -> None:
        if not self.done:
            self._done.set()
            self._outbox.forget(self.request_id, len(self._choices))
            self._engine.abort(self._stream)  # a stop string or an error: free the sequence now


def _exception_error(exc: BaseException) -> GenerationChunk:
    """An admitted request's failure: the server's, whatever the error (a 500)."""
    if isinstance(exc, WorkerError):
        return GenerationChunk(error=dataclasses.replace(exc.info(), status=500))
    return GenerationChunk(error=ErrorInfo(500, f"this request failed inside the engine ({type(exc).__name__}: "
                                                f"{exc})", type="internal_error", code="engine_error"))


def _step_error(failed: TokenEvent) -> GenerationChunk:
    if failed.error_is_grammar:
        # The request's own schema or grammar: it allowed a start it cannot finish.
        return GenerationChunk(error=ErrorInfo(
            400, f"the output constraint reached a point no token can continue ({failed.error})",
            code="invalid_grammar"))
    return GenerationChunk(error=ErrorInfo(500, f"this request failed inside the engine ({failed.error})",
                                           type="internal_error", code="engine_error"))
