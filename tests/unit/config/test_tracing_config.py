"""`server.tracing` (workers/contract/tracing.py): off by default, strict, named by dotted
path when wrong; `build_app` hands it to every worker deployment only when configured; and
a configured tracer really posts its spans over OTLP/HTTP (a collector on loopback)."""

from __future__ import annotations

import http.server
import threading

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

from serve_app.app import build_app
from serve_app.config.app_config import ConfigError, ServerOptions, parse_app_config
from workers.contract.tracing import (
    TracingConfig,
    build_provider,
    inject_context,
    tracer_for,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's pydantic models


def test_tracing_is_off_by_default():
    config = ServerOptions().tracing
    assert (config.otlp_traces_endpoint, config.service_name, config.sample_ratio) == (None, "chatserve", 1.0)
    assert not config.enabled
    assert tracer_for(config, "chatserve.ingress") is None and tracer_for(None, "chatserve.ingress") is None


@pytest.mark.parametrize("tracing, problem", [
    ({"otlp_traces_endpoint": "collector:4318"}, "server.tracing.otlp_traces_endpoint: String should match pattern"),
    ({"otlp_traces_endpoint": "http://c:4318/v1/traces", "collect_detailed": True},
     "server.tracing.collect_detailed: Extra inputs are not permitted"),
    ({"sample_ratio": 1.5}, "server.tracing.sample_ratio: Input should be less than or equal to 1"),
    ({"service_name": ""}, "server.tracing.service_name: String should have at least 1 character"),
])
def test_a_bad_tracing_key_is_named_by_its_dotted_path(tracing, problem):
    with pytest.raises(ConfigError, match=problem):
        parse_app_config({"models": [{"id": "m"}], "server": {"tracing": tracing}})


def worker_tracing_args(app) -> list:
    """What each worker deployment of a built app is given as its `tracing` argument."""
    workers = app._bound_deployment.init_args[1]
    return [worker._bound_deployment.init_args[3] for worker in workers.values()]


def test_build_app_gives_every_worker_the_tracing_config_only_when_configured():
    models = [{"id": "a"}, {"id": "b"}]
    assert worker_tracing_args(build_app({"models": models})) == [None, None]
    tracing = {"otlp_traces_endpoint": "http://collector:4318/v1/traces", "sample_ratio": 0.25}
    args = worker_tracing_args(build_app({"models": models, "server": {"tracing": tracing}}))
    assert args == [{**tracing, "service_name": "chatserve"}] * 2
    assert TracingConfig.model_validate(args[0]).enabled


class Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector's traces endpoint: keeps each POST's path, type and body."""

    received: list[tuple[str, str, bytes]] = []  # reset by the test

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_configured_tracer_posts_its_spans_to_the_otlp_http_endpoint(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # loopback only, whatever proxy the environment names
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    Collector.received = []
    server = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        config = TracingConfig(otlp_traces_endpoint=f"http://127.0.0.1:{server.server_port}/v1/traces",
                               service_name="chatserve-test")
        provider = build_provider(config)  # the OTLP exporter: what `tracer_for` builds
        tracer = provider.get_tracer("chatserve.ingress")
        span = tracer.start_span("POST /v1/chat/completions", attributes={"gen_ai.request.model": "m"})
        traceparent = inject_context(span)["traceparent"]
        span.end()
        assert provider.force_flush(10_000)
        provider.shutdown()
    finally:
        server.shutdown()
        server.server_close()
    ((path, content_type, body),) = Collector.received
    assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
    export = ExportTraceServiceRequest.FromString(body)
    (resource_spans,) = export.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "chatserve-test"
    (scope_spans,) = resource_spans.scope_spans
    assert scope_spans.scope.name == "chatserve.ingress"
    (exported,) = scope_spans.spans
    assert exported.name == "POST /v1/chat/completions"
    assert f"{exported.trace_id.hex()}-{exported.span_id.hex()}" in traceparent
    assert {a.key: a.value.string_value for a in exported.attributes} == {"gen_ai.request.model": "m"}
