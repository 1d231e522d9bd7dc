"""The worker's OpenTelemetry spans of a traced request, built once it ends, from the
timings the worker measures anyway.

A request is traced when tracing is configured (`server.tracing`, passed to each worker
deployment by `build_app`) and the ingress sent its span's context along
(`GenerateRequest.trace_context`: only for a sampled request). Such a request's chunks
pass through a `TracedRequest` on their way to the outbox, which keeps what the spans need
(each choice's first and last token time from the chunk's `prefill_time_ms` and
`decode_times_ms`, the engine's queue time, usage, finish reasons, an error); when the
request ends, `record_spans` writes them with explicit start and end times, children of
the ingress's span:

    chatserve.worker   (SERVER) the worker call, arrival to end: request id, model, side,
                                usage, finish reasons, resumed / handed off / cancelled, errors
      chatserve.admit           chat template, tokenizing, checks, grammar compile, resume replay
      chatserve.queue           waiting for the engine's first step of it (the engine's queue time)
      chatserve.prefill         from that step to the first new token (prompt and cached tokens)
      chatserve.decode          first to last token (tokens after each choice's first, mean gap)

Nothing of this runs for a request that is not traced (`WorkerTracing.begin` returns None,
and the worker is left with its plain outbox), and nothing at all without the config (the
request processor holds no `WorkerTracing`). The spans' times come from `perf_counter`,
turned into wall-clock time once, when the request ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.requests import GenerateRequest
from workers.contract.tracing import TracingConfig, extract_context, tracer_for

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from workers.serving.outbox import ChunkOutbox

logger = logging.getLogger(__name__)


@dataclass
class RequestTiming:
    """A finished request, as its spans tell it: times are `perf_counter()` seconds;
    `end_wall_ns` is `time.time_ns()` taken with `end`, which places them all in wall time."""

    request_id: str
    arrival: float
    end: float
    end_wall_ns: int
    admitted: float | None = None  # admission done (the request queued in the engine, or refused)
    queue_s: float | None = None  # the engine's wait before its first step of the request
    first_token: float | None = None  # the earliest first new token of any choice
    last_token: float | None = None  # the latest token of any choice
    decode_tokens: int = 0  # tokens after each choice's first
    decode_s: float = 0.0  # their gaps, summed
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    finish_reasons: list[str] = field(default_factory=list)
    error: ErrorInfo | None = None  # an error chunk the request ended with
    failure: str | None = None  # an exception that ended its path on the worker (its type)
    cancelled: bool = False  # the caller went away (client gone, or its stream moved elsewhere)
    resumed: bool = False
    handed_off: bool = False  # a prefill replica's request, handed to a decode replica
    kv_received: bool = False  # a decode replica's request, its prompt blocks taken from a prefill replica


def record_spans(tracer: Tracer, trace_context: dict[str, str], model: str, side: str, timing: RequestTiming) -> None:
    """Write the spans of a finished request under the span `trace_context` names."""
    from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

    def ns(t: float) -> int:
        return timing.end_wall_ns - round((timing.end - t) * 1e9)

    attributes: dict[str, Any] = {
        "chatserve.request_id": timing.request_id, "gen_ai.request.model": model, "chatserve.worker.side": side,
        "gen_ai.usage.input_tokens": timing.prompt_tokens, "gen_ai.usage.output_tokens": timing.completion_tokens,
        "chatserve.resumed": timing.resumed, "chatserve.handed_off": timing.handed_off,
        "chatserve.kv_received": timing.kv_received, "chatserve.cancelled": timing.cancelled,
    }
    if timing.finish_reasons:
        attributes["gen_ai.response.finish_reasons"] = timing.finish_reasons
    if timing.cached_tokens is not None:
        attributes["chatserve.cached_tokens"] = timing.cached_tokens
    status = None
    if timing.error is not None:
        attributes.update({"error.type": timing.error.type, "chatserve.error.status": timing.error.status})
        if timing.error.code is not None:
            attributes["chatserve.error.code"] = timing.error.code
        status = Status(StatusCode.ERROR, timing.error.type)
    elif timing.failure is not None:
        attributes["error.type"] = timing.failure
        status = Status(StatusCode.ERROR, timing.failure)
    worker = tracer.start_span("chatserve.worker", context=extract_context(trace_context), kind=SpanKind.SERVER,
                               start_time=ns(timing.arrival), attributes=attributes)
    parent = set_span_in_context(worker)

    def child(name: str, start: float, end: float, **attrs: Any) -> None:
        span = tracer.start_span(name, context=parent, start_time=ns(start), attributes=attrs)
        span.end(end_time=ns(max(start, end)))

    admitted = timing.admitted if timing.admitted is not None else timing.end
    child("chatserve.admit", timing.arrival, admitted)
    first, last = timing.first_token, timing.last_token
    if timing.queue_s is not None:
        # Queued when admission ended (the engine thread takes it a moment later), run when
        # its queue time had passed: never after its first token.
        run = admitted + timing.queue_s
        if first is not None:
            run = min(run, first)
        child("chatserve.queue", admitted, run)
        if first is not None:
            prefill = {"gen_ai.usage.input_tokens": timing.prompt_tokens}
            if timing.cached_tokens is not None:
                prefill["chatserve.cached_tokens"] = timing.cached_tokens
            child("chatserve.prefill", run, first, **prefill)
    if first is not None and last is not None and timing.decode_tokens:
        child("chatserve.decode", first, last, **{
            "chatserve.decode.tokens": timing.decode_tokens,
            "chatserve.decode.mean_token_ms": round(timing.decode_s * 1000 / timing.decode_tokens, 3)})
    if status is not None:
        worker.set_status(status)
    worker.end(end_time=timing.end_wall_ns)


class WorkerTracing:
    """A worker replica's tracer; `begin` starts following a traced request."""

    def __init__(self, tracer: Tracer, model: str, side: str = "colocated") -> None:
        self.tracer = tracer
        self.model = model
        self.side = side

    @classmethod
    def from_config(cls, config: TracingConfig | dict | None, model: str, side: str = "colocated") -> WorkerTracing | None:
        """None (and nothing built) when tracing is not configured."""
        if isinstance(config, dict):
            config = TracingConfig.model_validate(config)
        tracer = tracer_for(config, "chatserve.worker")
        return None if tracer is None else cls(tracer, model, side)

    def begin(self, request: GenerateRequest, outbox: ChunkOutbox, arrival: float) -> TracedRequest | None:
        """The request's chunks' way to `outbox`, noting its timings (None: not traced).
        `arrival` must be the `perf_counter()` its choices time their tokens from."""
        if request.trace_context is None:
            return None
        return TracedRequest(self, request, outbox, arrival)


class TracedRequest:
    """Stands in for the request's outbox: chunks go on to it unchanged, and their timings
    are kept. A context manager around the request's run: leaving it writes the spans."""

    def __init__(self, tracing: WorkerTracing, request: GenerateRequest, outbox: ChunkOutbox, arrival: float) -> None:
        self._tracing = tracing
        self._request = request
        self._outbox = outbox
        self._arrival = arrival
        self._request_id = request.request_id
        self._last: dict[int, float] = {}  # per choice: its latest token's time
        self._first: float | None = None
        self.timing = RequestTiming(request.request_id, arrival, arrival, 0,
                                    resumed=request.resume is not None and not request.resume.is_empty,
                                    kv_received=request.kv_handoff is not None)

    # -- the outbox's interface -------------------------------------------------------

    def put(self, request_id: str, chunk: GenerationChunk) -> None:
        if request_id == self._request_id:
            self._note(chunk)  # before the outbox may merge it into a chunk still waiting
        self._outbox.put(request_id, chunk)

    def forget(self, request_id: str, num_choices: int) -> None:
        self._outbox.forget(request_id, num_choices)

    def drop(self, request_id: str) -> None:
        self._outbox.drop(request_id)

    def __getattr__(self, name: str) -> Any:  # anything else of the outbox, unchanged
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._outbox, name)

    # -- the request's run --------------------------------------------------------------

    def admitted(self) -> None:
        self.timing.admitted = time.perf_counter()

    def __enter__(self) -> TracedRequest:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        timing = self.timing
        timing.end, timing.end_wall_ns = time.perf_counter(), time.time_ns()
        if exc is not None:
            if isinstance(exc, Exception):
                timing.failure = type(exc).__name__
            else:
                timing.cancelled = True  # CancelledError: the caller went away
        if self._last:
            timing.first_token, timing.last_token = self._first, max(self._last.values())
        tracing = self._tracing
        try:
            record_spans(tracing.tracer, self._request.trace_context, tracing.model, tracing.side, timing)
        except Exception:  # tracing never fails a request
            logger.exception("writing the spans of request %s failed", self._request_id)

    def _note(self, chunk: GenerationChunk) -> None:
        timing = self.timing
        if chunk.error is not None and timing.error is None:
            timing.error = chunk.error
        if chunk.handoff is not None:
            timing.handed_off = True
        if chunk.queue_time_ms is not None and timing.queue_s is None:
            timing.queue_s = chunk.queue_time_ms / 1000
        if chunk.prompt_tokens:
            timing.prompt_tokens = chunk.prompt_tokens
        timing.completion_tokens = max(timing.completion_tokens, chunk.completion_tokens)
        if chunk.cached_tokens is not None:
            timing.cached_tokens = chunk.cached_tokens
        if chunk.finish_reason is not None:
            timing.finish_reasons.append(chunk.finish_reason)
        gaps = chunk.decode_times_ms
        last = self._last.get(chunk.index)
        if last is None:
            # The choice's first new token: timed from arrival (a resumed choice's first
            # new token is its first decode gap, counted from arrival too).
            if chunk.prefill_time_ms is not None:
                first_ms = chunk.prefill_time_ms
            elif gaps:
                first_ms, gaps = gaps[0], gaps[1:]
            else:
                return  # no new token (an error, a replayed choice's end, a hand-over)
            last = self._arrival + first_ms / 1000
            self._first = last if self._first is None else min(self._first, last)
        if gaps:
            spent = sum(gaps) / 1000
            last += spent
            timing.decode_s += spent
            timing.decode_tokens += len(gaps)
        self._last[chunk.index] = last
