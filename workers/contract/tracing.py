"""OpenTelemetry tracing, shared by the ingress and the model workers: its config
(`server.tracing`, vLLM's `otlp_traces_endpoint`), the tracer a process builds from it, and
the W3C trace context (`traceparent`, `tracestate`) a `GenerateRequest` carries from the
ingress's request span to the worker's spans.

Nothing here imports OpenTelemetry until a tracer is built: with `otlp_traces_endpoint`
unset, `tracer_for` returns None and the ingress and the workers create no tracer and no
span (their hooks are one `is None` test a request, none a token). Each process keeps
its own `TracerProvider` (never the global one, which Ray or a host app may own), one per
config, exporting over OTLP/HTTP (protobuf) in batches from a background thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer


class TracingConfig(BaseModel):
    """OpenTelemetry spans of each generating request, at the ingress and on its workers
    (docs/API.md, "Tracing"). With `otlp_traces_endpoint` unset, nothing is traced: no
    tracer, no span, no exporter."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    otlp_traces_endpoint: str | None = Field(
        None, pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="vLLM's name: the full OTLP/HTTP (protobuf) traces URL spans are posted to, e.g. "
        "http://otel-collector:4318/v1/traces; unset: no tracer, no spans, no exporter")
    service_name: str = Field("chatserve", min_length=1, description="the spans' `service.name` resource attribute")
    sample_ratio: float = Field(
        1.0, ge=0, le=1, description="share of requests traced when the client sends no `traceparent` (by trace "
        "id); a client's `traceparent` decides for its own request (its sampled flag)")

    @property
    def enabled(self) -> bool:
        return self.otlp_traces_endpoint is not None


# One provider per config in this process (an ingress and a worker replica may share a process in tests).
_PROVIDERS: dict[TracingConfig, TracerProvider] = {}


def tracer_for(config: TracingConfig | None, scope: str) -> Tracer | None:
    """This process's tracer for `scope` (e.g. "chatserve.ingress") under `config`, its
    provider built at the first call; None when tracing is not configured."""
    if config is None or not config.enabled:
        return None
    provider = _PROVIDERS.get(config)
    if provider is None:
        provider = _PROVIDERS[config] = build_provider(config)
    return provider.get_tracer(scope)


def build_provider(config: TracingConfig, exporter: SpanExporter | None = None) -> TracerProvider:
    """A provider that samples as `config` says and exports in batches to `exporter`, else
    over OTLP/HTTP to `config.otlp_traces_endpoint`. Its spans are flushed at exit."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )

        exporter = OTLPSpanExporter(endpoint=config.otlp_traces_endpoint)
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
                              resource=Resource.create({"service.name": config.service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def extract_context(carrier: Mapping[str, str] | None) -> Context:
    """The W3C trace context in `carrier` (HTTP headers, or a request's `trace_context`); an
    empty context when it holds none, or a malformed one."""
    from opentelemetry.trace.propagation.tracecontext import (
        TraceContextTextMapPropagator,
    )

    return TraceContextTextMapPropagator().extract(carrier or {})


def inject_context(span: Span) -> dict[str, str]:
    """`span`'s W3C trace context (`traceparent`, and `tracestate` when it has one): what a
    remote callee's spans name as their parent."""
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import (
        TraceContextTextMapPropagator,
    )

    carrier: dict[str, Any] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return carrier
