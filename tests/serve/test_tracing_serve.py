"""Tracing through Ray Serve: the tiny app with `server.tracing` pointing at a collector on
loopback in this process. A chat request with a client `traceparent` gives the ingress
replica's spans and the worker replica's spans, each posted by its own process over
OTLP/HTTP, in the client's trace, the worker's under the ingress's server span."""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    delete_app,
    run_app,
    tiny_app_args,
)
from tests.support.tracing import CLIENT_SPAN_ID, CLIENT_TRACE_ID, TRACEPARENT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

APP = "traced"


class Collector(http.server.BaseHTTPRequestHandler):
    spans: list = []  # (service name, span) of every span received

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        export = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
        for resource_spans in export.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend((service, span) for span in scope_spans.spans)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def collector():
    Collector.spans = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1/traces"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def traced_app(serve_instance, tiny_model_dir, collector):
    args = tiny_app_args(tiny_model_dir)
    args["server"] = {"tracing": {"otlp_traces_endpoint": collector, "service_name": "chatserve-traced"}}
    # Each process exports its batch of spans every 0.2 s instead of the SDK's 5 s (the
    # standard variable), so each test waits a fraction of a second for them.
    fast_export = {"runtime_env": {"env_vars": {"OTEL_BSP_SCHEDULE_DELAY": "200"}}}
    for options in (args["ingress"]["ray_actor_options"], args["models"][0]["deployment"]["ray_actor_options"]):
        options.update(fast_export)
    yield run_app(serve_instance, APP, args)
    delete_app(APP)


def spans_of(trace_id: int, wanted: set[str]) -> dict:
    """The collected spans of a trace by name, once all of `wanted` are in (each process
    exports its batch within 0.2 s here); exactly `wanted`."""
    deadline = time.time() + 30
    while time.time() < deadline:
        ours = {span.name: span for _, span in Collector.spans if int.from_bytes(span.trace_id, "big") == trace_id}
        if wanted <= set(ours):
            break
        time.sleep(0.5)
    assert set(ours) == wanted
    return ours


def test_ingress_and_worker_spans_reach_the_collector_in_the_clients_trace(traced_app):
    body = {"model": TINY_MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
            "ignore_eos": True}
    reply = httpx.post(traced_app + "/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT},
                       timeout=60)
    assert reply.status_code == 200
    wanted = {"POST /v1/chat/completions", "chatserve.parse", "chatserve.stream", "chatserve.worker",
              "chatserve.admit", "chatserve.queue", "chatserve.prefill", "chatserve.decode"}
    ours = spans_of(CLIENT_TRACE_ID, wanted)
    assert {service for service, _ in Collector.spans} == {"chatserve-traced"}
    server, worker = ours["POST /v1/chat/completions"], ours["chatserve.worker"]
    assert int.from_bytes(server.parent_span_id, "big") == CLIENT_SPAN_ID
    assert worker.parent_span_id == server.span_id
    assert ours["chatserve.decode"].parent_span_id == worker.span_id
    attributes = {a.key: a.value for a in worker.attributes}
    assert attributes["gen_ai.usage.output_tokens"].int_value == 4
    assert attributes["gen_ai.request.model"].string_value == TINY_MODEL_ID
    assert reply.json()["id"] == attributes["chatserve.request_id"].string_value


def test_an_embeddings_request_is_traced_on_both_sides(traced_app):
    """/v1/embeddings: the ingress's spans and the worker's (admission, queue, the inputs'
    prefill) in the client's trace, the operation and the input tokens named."""
    trace_id, span_id = 0x1F2E3D4C5B6A79881F2E3D4C5B6A7988, 0x0123456789ABCDEF
    body = {"model": TINY_MODEL_ID, "input": ["Hi there", "Bye"]}
    reply = httpx.post(traced_app + "/v1/embeddings", json=body,
                       headers={"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"}, timeout=60)
    assert reply.status_code == 200
    wanted = {"POST /v1/embeddings", "chatserve.parse", "chatserve.worker", "chatserve.admit", "chatserve.queue",
              "chatserve.prefill"}
    ours = spans_of(trace_id, wanted)
    server, worker = ours["POST /v1/embeddings"], ours["chatserve.worker"]
    assert int.from_bytes(server.parent_span_id, "big") == span_id
    assert ours["chatserve.parse"].parent_span_id == worker.parent_span_id == server.span_id
    assert ours["chatserve.prefill"].parent_span_id == worker.span_id
    worker_attributes = {a.key: a.value for a in worker.attributes}
    assert worker_attributes["gen_ai.usage.input_tokens"].int_value == reply.json()["usage"]["prompt_tokens"]
    attributes = {a.key: a.value for a in server.attributes}
    assert attributes["gen_ai.operation.name"].string_value == "embeddings"
    assert attributes["gen_ai.request.model"].string_value == TINY_MODEL_ID
    assert attributes["gen_ai.usage.input_tokens"].int_value == reply.json()["usage"]["prompt_tokens"] > 0
    assert attributes["http.response.status_code"].int_value == 200


def test_a_tokenize_request_is_traced_at_the_ingress(traced_app):
    """/tokenize through Serve: the server span in the client's trace, the count as its input tokens."""
    trace_id, span_id = 0x2E3D4C5B6A7988991F2E3D4C5B6A7988, 0x0123456789ABCDEF
    reply = httpx.post(traced_app + "/tokenize", json={"model": TINY_MODEL_ID, "prompt": "Hi there"},
                       headers={"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"}, timeout=60)
    assert reply.status_code == 200
    ours = spans_of(trace_id, {"POST /tokenize", "chatserve.parse"})
    server = ours["POST /tokenize"]
    assert int.from_bytes(server.parent_span_id, "big") == span_id
    assert ours["chatserve.parse"].parent_span_id == server.span_id
    attributes = {a.key: a.value for a in server.attributes}
    assert attributes["gen_ai.usage.input_tokens"].int_value == reply.json()["count"] > 0
    assert "gen_ai.operation.name" not in attributes


def test_a_handle_call_is_traced_under_the_callers_traceparent(traced_app):
    """The handle API from this driver (no HTTP): `trace_headers` carries the caller's
    `traceparent`; the ingress's spans (`CALL handle:chat`) and the worker's join its trace."""
    from ray import serve

    trace_id, span_id = 0x2A2B2C2D2E2F30313233343536373839, 0x1122334455667788
    handle = serve.get_app_handle(APP)
    body = {"model": TINY_MODEL_ID, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}],
            "ignore_eos": True}
    reply = handle.chat.remote(body, trace_headers={"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"}).result()
    wanted = {"CALL handle:chat", "chatserve.parse", "chatserve.stream", "chatserve.worker", "chatserve.admit",
              "chatserve.queue", "chatserve.prefill", "chatserve.decode"}
    ours = spans_of(trace_id, wanted)
    server, worker = ours["CALL handle:chat"], ours["chatserve.worker"]
    assert int.from_bytes(server.parent_span_id, "big") == span_id and worker.parent_span_id == server.span_id
    attributes = {a.key: a.value for a in server.attributes}
    assert attributes["gen_ai.usage.output_tokens"].int_value == reply.usage.completion_tokens == 3
    assert attributes["gen_ai.response.id"].string_value == reply.id
