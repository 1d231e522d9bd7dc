"""The ingress's spans of a generating request (serve_app/http/tracing.py), no Ray: the
ingress's own `_parse` and `_generate` on a fake worker deployment. The client's
`traceparent` is the server span's parent; the parse and stream spans are its children;
the worker request carries the server span's context, and the worker's spans (the
request processor on the tiny model) land under it in the same trace. The tokenizer routes
get a server and a parse span, and stay out of the request metrics. Without the config,
no tracer or span exists and the worker request carries nothing."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json

import pytest
from opentelemetry.trace import SpanKind, StatusCode
from starlette.requests import Request

from serve_app import ingress as ingress_module
from serve_app.config.app_config import AppConfig
from serve_app.dialects.chat.route import CHAT
from serve_app.dialects.completions import COMPLETIONS
from serve_app.dialects.table import DIALECTS
from serve_app.http.auth import APIKeyAuth
from serve_app.http.errors import APIError
from serve_app.http.metrics import IngressMetrics
from serve_app.http.tracing import IngressTracing
from serve_app.ingress import ChatIngress
from serve_app.lora.adapters import AdapterCatalog
from serve_app.media.images import MediaResolver
from serve_app.transport.channels import WorkerChannels
from tests.support.engines import make_engine, with_async_engine
from tests.support.tracing import (
    CLIENT_SPAN_ID,
    CLIENT_TRACE_ID,
    TRACEPARENT,
    MemoryTracing,
    otel_objects_created,
)
from tests.unit.api.test_worker_call import NO_RESUME, FakeHandle
from workers.contract.chunks import GenerationChunk
from workers.contract.tracing import TracingConfig
from workers.contract.worker_info import ModelInfo
from workers.serving.request_processor import RequestProcessor
from workers.serving.request_trace import WorkerTracing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's pydantic models

_METHODS = ("_parse", "_generate", "_prepare", "_target", "_worker", "_check_token_ids", "_with_images", "_info",
            "_parse_admin", "_tokenize", "tokenize", "count_tokens")
IngressState = type("IngressState", (), {name: getattr(ChatIngress.func_or_class, name) for name in _METHODS})

WORKER_OUTPUT = [
    GenerationChunk(text="Hel", token_ids=[1], prompt_tokens=7, completion_tokens=1, prefill_time_ms=5.0),
    GenerationChunk(text="lo", token_ids=[2], prompt_tokens=7, completion_tokens=2, decode_times_ms=[1.0],
                    finish_reason="stop"),
]


def ingress(tracing: IngressTracing | None, output: list = WORKER_OUTPUT):
    """The ingress's state that the generate path reads, one model `base` whose worker
    deployment (a fake handle, no channel) answers `output`."""
    state = IngressState()
    state.config = AppConfig.model_validate({"models": [{"id": "base"}]})
    state.adapters = AdapterCatalog(state.config, None)
    state.media = MediaResolver(state.config.server.media)
    state.auth = APIKeyAuth()
    state.metrics = IngressMetrics(["base"])
    state.handle = FakeHandle(output)
    state.workers = {"base": state.handle}
    state.transports = {"base": WorkerChannels(state.handle, NO_RESUME)}
    state._infos = {"base": ModelInfo(id="base", max_model_len=256, vocab_size=100, kv_cache_blocks=4, block_size=16)}
    state.dialect_states = {d.path: d.state(state.config.server) for d in DIALECTS if d.state is not None}
    state.tracing = tracing
    return state


def http_request(path: str, body: dict, headers: dict[str, str] | None = None) -> Request:
    raw = json.dumps(body).encode()
    all_headers = {"content-type": "application/json", "content-length": str(len(raw)), **(headers or {})}
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in all_headers.items()]}
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(scope, receive)


def serve(state, dialect=CHAT, headers: dict[str, str] | None = None, **fields) -> int:
    """One request through `_generate` (streamed responses read to their end), an APIError
    answered by the ingress's own handler; the response's status."""
    body = {"model": "base", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **fields}
    request = http_request(dialect.path, body, headers)

    async def run() -> int:
        try:
            response = await state._generate(request, dialect)
        except APIError as exc:
            return (await ingress_module._api_error(request, exc)).status_code
        if hasattr(response, "body_iterator"):
            async for _ in response.body_iterator:
                pass
        return response.status_code

    return contextvars.Context().run(asyncio.run, run())


@pytest.mark.parametrize("stream", [False, True], ids=["one body", "streamed"])
def test_the_server_span_is_the_clients_child_with_parse_and_stream_spans_and_the_worker_gets_its_context(stream):
    memory = MemoryTracing()
    state = ingress(IngressTracing(memory.tracer("chatserve.ingress")))
    assert serve(state, headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"}, stream=stream) == 200
    spans = memory.spans()
    assert set(spans) == {"POST /v1/chat/completions", "chatserve.parse", "chatserve.stream"}
    server = spans["POST /v1/chat/completions"]
    assert server.kind is SpanKind.SERVER
    assert (server.context.trace_id, server.parent.span_id) == (CLIENT_TRACE_ID, CLIENT_SPAN_ID)
    assert server.context.trace_state.get("vendor") == "1"
    for child in ("chatserve.parse", "chatserve.stream"):
        assert spans[child].parent.span_id == server.context.span_id
        assert spans[child].context.trace_id == CLIENT_TRACE_ID
    parse, streamed = spans["chatserve.parse"], spans["chatserve.stream"]
    assert server.start_time <= parse.start_time <= parse.end_time <= streamed.start_time <= streamed.end_time
    assert streamed.end_time <= server.end_time
    attributes = dict(server.attributes)
    request_id = attributes.pop("gen_ai.response.id")
    assert request_id.startswith("chatcmpl-")
    assert attributes == {
        "http.request.method": "POST", "http.route": "/v1/chat/completions", "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "base", "gen_ai.request.max_tokens": 3, "gen_ai.request.temperature": 1.0,
        "gen_ai.request.top_p": 1.0, "gen_ai.request.choice.count": 1, "http.response.status_code": 200,
        "gen_ai.usage.input_tokens": 7, "gen_ai.usage.output_tokens": 2, "gen_ai.response.finish_reasons": ("stop",)}
    assert server.status.status_code is StatusCode.UNSET
    (sent,) = state.handle.sent
    context = sent.trace_context
    assert context["traceparent"] == f"00-{CLIENT_TRACE_ID:032x}-{server.context.span_id:016x}-01"
    assert context["tracestate"] == "vendor=1"


def test_the_worker_spans_of_the_request_land_under_the_ingress_span_in_the_clients_trace(paged_model,
                                                                                            tiny_tokenizer):
    """Across the boundary: the request the ingress sent, run by the worker's request
    processor on the tiny model with tracing on."""
    memory = MemoryTracing()
    state = ingress(IngressTracing(memory.tracer("chatserve.ingress")))
    assert serve(state, headers={"traceparent": TRACEPARENT}) == 200
    (sent,) = state.handle.sent
    tracing = WorkerTracing(memory.tracer("chatserve.worker"), "base")

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer, tracing=tracing)
        return [chunk async for batch in processor.stream(sent) for chunk in batch]

    chunks = asyncio.run(with_async_engine(make_engine(paged_model, max_model_len=256), body))
    assert chunks[-1].finish_reason is not None and chunks[-1].error is None
    spans = memory.spans()
    server, worker = spans["POST /v1/chat/completions"], spans["chatserve.worker"]
    assert {s.context.trace_id for s in spans.values()} == {CLIENT_TRACE_ID}
    assert server.parent.span_id == CLIENT_SPAN_ID
    assert worker.parent.span_id == server.context.span_id and worker.parent.is_remote
    assert worker.attributes["chatserve.request_id"] == server.attributes["gen_ai.response.id"] == sent.request_id
    for phase in ("chatserve.admit", "chatserve.queue", "chatserve.prefill"):
        assert spans[phase].parent.span_id == worker.context.span_id
    assert worker.attributes["gen_ai.usage.output_tokens"] == chunks[-1].completion_tokens


def test_a_request_refused_in_parsing_ends_its_spans_with_the_status():
    memory = MemoryTracing()
    state = ingress(IngressTracing(memory.tracer("chatserve.ingress")))
    assert serve(state, headers={"traceparent": TRACEPARENT}, temperature=5) == 400
    spans = memory.spans()
    assert set(spans) == {"POST /v1/chat/completions", "chatserve.parse"}
    server, parse = spans["POST /v1/chat/completions"], spans["chatserve.parse"]
    assert server.attributes["http.response.status_code"] == 400
    assert server.attributes["error.type"] == "invalid_request_error"
    assert server.status.status_code is StatusCode.UNSET  # a client's error is not the server's
    assert parse.status.status_code is StatusCode.ERROR
    assert state.handle.sent == []


def test_a_worker_error_after_the_first_chunk_marks_the_spans_failed():
    from workers.contract.chunks import ErrorInfo

    output = [WORKER_OUTPUT[0], GenerationChunk(error=ErrorInfo(500, "engine failed", type="internal_error"))]
    memory = MemoryTracing()
    state = ingress(IngressTracing(memory.tracer("chatserve.ingress")), output)
    assert serve(state, stream=True) == 200  # the error travels as the stream's last event
    spans = memory.spans()
    server = spans["POST /v1/chat/completions"]
    assert server.parent is None  # no traceparent: a trace of its own
    assert server.status.status_code is StatusCode.ERROR and server.attributes["error.type"] == "internal_error"
    assert spans["chatserve.stream"].status.status_code is StatusCode.ERROR


def test_every_part_of_a_split_request_carries_the_context():
    memory = MemoryTracing()
    output = [dataclasses.replace(WORKER_OUTPUT[1], text="x")]
    state = ingress(IngressTracing(memory.tracer("chatserve.ingress")), output)
    body = {"prompt": ["a", "b"]}
    serve(state, COMPLETIONS, headers={"traceparent": TRACEPARENT}, **body)
    server = memory.spans()["POST /v1/completions"]
    assert server.attributes["gen_ai.operation.name"] == "text_completion"
    assert len(state.handle.sent) == 2
    assert {r.trace_context["traceparent"] for r in state.handle.sent} == {
        f"00-{CLIENT_TRACE_ID:032x}-{server.context.span_id:016x}-01"}


@pytest.mark.parametrize("traceparent, sample_ratio", [
    (TRACEPARENT[:-2] + "00", 1.0),  # the client's trace is not sampled
    (None, 0.0),  # no client trace, and none sampled
])
def test_an_unsampled_request_exports_nothing_and_sends_no_context(traceparent, sample_ratio):
    memory = MemoryTracing(TracingConfig(otlp_traces_endpoint="http://127.0.0.1:9/v1/traces",
                                         sample_ratio=sample_ratio))
    state = ingress(IngressTracing(memory.tracer("chatserve.ingress")))
    assert serve(state, headers={"traceparent": traceparent} if traceparent else None) == 200
    assert memory.spans() == {}
    assert state.handle.sent[0].trace_context is None


def test_without_the_config_no_tracer_or_span_is_created_and_nothing_is_propagated():
    """The check counts: the same request with tracing on creates spans."""
    with otel_objects_created() as created:
        state = ingress(IngressTracing.from_config(TracingConfig()))
        assert state.tracing is None
        assert serve(state, headers={"traceparent": TRACEPARENT}, stream=True) == 200
    assert created == []
    assert state.handle.sent[0].trace_context is None
    with otel_objects_created() as created:
        state = ingress(IngressTracing(MemoryTracing().tracer("chatserve.ingress")))
        assert serve(state, headers={"traceparent": TRACEPARENT}, stream=True) == 200
    assert len(created) >= 4  # the client's span context, server, parse, stream


def test_a_configured_endpoint_gives_the_ingress_a_tracer():
    tracing = IngressTracing.from_config(TracingConfig(otlp_traces_endpoint="http://127.0.0.1:9/v1/traces"))
    assert tracing is not None and tracing.tracer is not None


class FakeTokenizerWorker:
    """Just the worker deployment's `tokenize.remote`, answering `result`."""

    def __init__(self, result) -> None:
        self.result = result
        self.tokenize = self

    async def remote(self, request):
        return self.result


def tokenizer_route(state, path: str, body: dict, headers: dict[str, str] | None = None) -> int:
    """One request to /tokenize or count_tokens, an APIError answered by the ingress's handler."""
    handler = state.tokenize if path == "/tokenize" else state.count_tokens
    request = http_request(path, body, headers)

    async def run() -> int:
        try:
            return (await handler(request)).status_code
        except APIError as exc:
            return (await ingress_module._api_error(request, exc)).status_code

    return contextvars.Context().run(asyncio.run, run())


TOKENIZER_REQUESTS = [
    ("/tokenize", {"model": "base", "prompt": "Hi there"}),
    ("/v1/messages/count_tokens", {"model": "base", "messages": [{"role": "user", "content": "Hi there"}]}),
]


@pytest.mark.parametrize(("path", "body"), TOKENIZER_REQUESTS, ids=["tokenize", "count_tokens"])
def test_a_tokenizer_route_gets_a_server_and_a_parse_span_and_no_metrics(path, body):
    from workers.contract.tokenize import TokenizeResult

    memory = MemoryTracing()
    state = ingress(IngressTracing(memory.tracer("chatserve.ingress")))
    state.workers = {"base": FakeTokenizerWorker(TokenizeResult(tokens=[5, 6, 7], max_model_len=256))}
    assert tokenizer_route(state, path, body, {"traceparent": TRACEPARENT}) == 200
    spans = memory.spans()
    assert set(spans) == {f"POST {path}", "chatserve.parse"}
    server, parse = spans[f"POST {path}"], spans["chatserve.parse"]
    assert (server.context.trace_id, server.parent.span_id) == (CLIENT_TRACE_ID, CLIENT_SPAN_ID)
    assert parse.parent.span_id == server.context.span_id and parse.end_time <= server.end_time
    assert dict(server.attributes) == {
        "http.request.method": "POST", "http.route": path, "gen_ai.request.model": "base",
        "http.response.status_code": 200, "gen_ai.usage.input_tokens": 3, "gen_ai.usage.output_tokens": 0}
    assert "chatserve_requests_total{" not in state.metrics.exposition().decode()  # generation requests only


@pytest.mark.parametrize(("path", "body"), TOKENIZER_REQUESTS, ids=["tokenize", "count_tokens"])
def test_a_refused_or_failed_tokenizer_request_ends_its_spans_with_the_status(path, body):
    from workers.contract.chunks import ErrorInfo

    memory = MemoryTracing()
    state = ingress(IngressTracing(memory.tracer("chatserve.ingress")))
    state.workers = {"base": FakeTokenizerWorker(ErrorInfo(500, "tokenizer failed", type="internal_error"))}
    assert tokenizer_route(state, path, {**body, "model": "nope"}) == 404
    assert tokenizer_route(state, path, body) == 500
    assert memory.provider.force_flush()
    refused, failed = sorted((s for s in memory.exporter.get_finished_spans() if s.name == f"POST {path}"),
                             key=lambda s: s.start_time)
    assert refused.attributes["http.response.status_code"] == 404 and refused.status.status_code is StatusCode.UNSET
    assert failed.attributes["http.response.status_code"] == 500 and failed.status.status_code is StatusCode.ERROR


def test_without_the_config_a_tokenizer_route_makes_no_record():
    from workers.contract.tokenize import TokenizeResult

    state = ingress(None)
    state.workers = {"base": FakeTokenizerWorker(TokenizeResult(tokens=[5], max_model_len=256))}
    with otel_objects_created() as created:
        assert tokenizer_route(state, *TOKENIZER_REQUESTS[0]) == 200
    assert created == []
