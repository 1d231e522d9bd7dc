"""The ingress's OpenTelemetry spans of a request, when `server.tracing` is configured.

One SERVER span per request of a generating route (serve_app/dialects/table.py), of
`/v1/embeddings` or of a tokenizer route (`/tokenize`, `/v1/messages/count_tokens`: a
server span and its parse span only, their count as `gen_ai.usage.input_tokens`), named
`POST <route>`, its parent the client's W3C `traceparent` when the
request sends one (else a new trace, sampled at `sample_ratio`). Its children:

- `chatserve.parse`: the body read and validated, the model resolved, the translation to
  the worker's request, token ids checked and images fetched (until the worker call);
- `chatserve.stream`: the worker's output, from its first chunk to the response's end;
- on the worker, under the same parent (workers/serving/request_trace.py): a
  `chatserve.worker` span per worker call, with its admission, queue, prefill and decode
  (an embedding request's: admission, queue, and its inputs' prefill to the last vector).

The server span's context goes to the worker in `GenerateRequest.trace_context`, only when
it is sampled. A span lives as long as the request's `RequestRecord` (serve_app/http/metrics.py):
its `finish`, called exactly once on every path (response sent, stream ended, client gone,
an error handler), ends the spans with the status, usage and finish reasons it gathered, so
nothing is done per chunk. The spans are never made current (no context is attached to the
request's task): every parent is explicit. Error messages stay out of spans (they may
quote the client's input); the error's type is kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from workers.contract.requests import GenerateRequest
from workers.contract.tracing import (
    TracingConfig,
    extract_context,
    inject_context,
    tracer_for,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from serve_app.http.metrics import RequestRecord

# What `gen_ai.operation.name` a route is (OpenTelemetry's GenAI conventions); others are chat.
_OPERATIONS = {"/v1/completions": "text_completion", "/v1/embeddings": "embeddings"}


class IngressTracing:
    """The tracer of an ingress replica; `begin` opens a request's spans."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    @classmethod
    def from_config(cls, config: TracingConfig) -> IngressTracing | None:
        """None (and nothing built) when tracing is not configured."""
        tracer = tracer_for(config, "chatserve.ingress")
        return None if tracer is None else cls(tracer)

    def begin(self, record: RequestRecord, method: str, headers: Mapping[str, str],
              model_operation: bool = True) -> RequestTrace:
        """Open the server and parse spans of the request `record` describes (its route is
        known), the server span under the client's `traceparent` in `headers`, if any;
        without a `model_operation` (the tokenizer routes) it names no GenAI operation."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        route = record.route
        attributes = {"http.request.method": method, "http.route": route}
        if model_operation:
            attributes["gen_ai.operation.name"] = _OPERATIONS.get(route, "chat")
        server = self.tracer.start_span(f"{method} {route}", context=extract_context(headers), kind=SpanKind.SERVER,
                                        attributes=attributes)
        parse = self.tracer.start_span("chatserve.parse", context=set_span_in_context(server))
        return RequestTrace(self.tracer, server, parse)


class RequestTrace:
    """One request's ingress spans; `record.trace` holds it, and the record's `finish` ends it."""

    def __init__(self, tracer: Tracer, server: Span, parse: Span) -> None:
        self.tracer = tracer
        self.server = server
        self.parse: Span | None = parse  # None once ended
        self.stream: Span | None = None

    def calling_worker(self, model: str) -> dict[str, str] | None:
        """The request is parsed and about to call its worker: end the parse span, name the
        model; the server span's context for the worker (None when not sampled: the worker
        then records nothing)."""
        self._end_parse()
        self.server.set_attribute("gen_ai.request.model", model)
        return inject_context(self.server) if self.server.is_recording() else None

    def worker_requests(self, requests: tuple[GenerateRequest, ...], model: str) -> tuple[GenerateRequest, ...]:
        """The request is parsed and about to call its workers: end the parse span, name the
        model and the first request's sampling parameters, and give each worker request the
        server span's trace context (when sampled: else the worker records nothing)."""
        context = self.calling_worker(model)
        first = requests[0]
        params = first.params
        self.server.set_attributes({"gen_ai.request.temperature": params.temperature,
                                    "gen_ai.request.top_p": params.top_p, "gen_ai.request.choice.count": params.n})
        if first.max_tokens is not None:  # None: the model's default cap, resolved by the worker
            self.server.set_attribute("gen_ai.request.max_tokens", first.max_tokens)
        if context is None:
            return requests
        return tuple(dataclasses.replace(r, trace_context=context) for r in requests)

    def first_chunk(self) -> None:
        """The worker's first chunk is in: the stream span starts."""
        from opentelemetry.trace import set_span_in_context

        self.stream = self.tracer.start_span("chatserve.stream", context=set_span_in_context(self.server))

    def finish(self, record: RequestRecord) -> None:
        """End every span still open, with what the record gathered (called by `record.finish`)."""
        from opentelemetry.trace import Status, StatusCode

        failed = record.status >= 500 or (record.status < 400 and record.error_type is not None)
        status = Status(StatusCode.ERROR, record.error_type) if failed else None
        if self.parse is not None:  # refused before any worker call (a 4xx, an error in parsing)
            if record.status >= 400:
                self.parse.set_status(Status(StatusCode.ERROR, record.error_type))
            self._end_parse()
        if self.stream is not None:
            if status is not None:
                self.stream.set_status(status)
            self.stream.end()
        attributes = {"http.response.status_code": record.status, "gen_ai.usage.input_tokens": record.prompt_tokens,
                      "gen_ai.usage.output_tokens": record.completion_tokens}
        if record.request_id is not None:
            attributes["gen_ai.response.id"] = record.request_id
        if record.finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = record.finish_reasons
        if record.error_type is not None:
            attributes["error.type"] = record.error_type
        self.server.set_attributes(attributes)
        if status is not None:
            self.server.set_status(status)
        self.server.end()

    def _end_parse(self) -> None:
        if self.parse is not None:
            self.parse.end()
            self.parse = None
