"""Tracing in tests: a tracer whose spans land in memory, a client's `traceparent`, span
lookups by name, and a count of every OpenTelemetry tracer, provider and span created."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from workers.contract.tracing import TracingConfig, build_provider

# A configured endpoint nothing listens on: the spans of these tracers go to memory instead.
CONFIG = TracingConfig(otlp_traces_endpoint="http://127.0.0.1:9/v1/traces")

CLIENT_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN_ID = 0xB7AD6B7169203331
TRACEPARENT = f"00-{CLIENT_TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"


class MemoryTracing:
    """A provider exporting to memory; `spans()` flushes it and returns what ended so far."""

    def __init__(self, config: TracingConfig = CONFIG) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = build_provider(config, self.exporter)

    def tracer(self, scope: str):
        return self.provider.get_tracer(scope)

    def spans(self) -> dict:
        """The ended spans by name (each name once)."""
        assert self.provider.force_flush()
        spans = self.exporter.get_finished_spans()
        by_name = {s.name: s for s in spans}
        assert len(by_name) == len(spans), [s.name for s in spans]
        return by_name


def _classes(base: type) -> list[type]:
    found, todo = [], [base]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo.extend(cls.__subclasses__())
    return found


@contextlib.contextmanager
def otel_objects_created() -> Iterator[list[type]]:
    """The class of every OpenTelemetry Span, Tracer and TracerProvider created inside the
    block (SDK, no-op, proxy and non-recording ones alike: each derives from one of the
    API's three classes), counted by wrapping every `__init__` they have."""
    created: dict[int, type] = {}  # by object: a subclass's __init__ calling its parent's counts once
    patched: list[tuple[type, object]] = []  # (class, its own __init__ or None)

    def counting(cls, init):
        def __init__(self, *args, **kwargs):
            created[id(self)] = type(self)
            if init is not None:
                init(self, *args, **kwargs)
            else:  # an API class without one: on along the MRO, as before
                super(cls, self).__init__(*args, **kwargs)
        return __init__

    for base in (trace.Span, trace.Tracer, trace.TracerProvider):
        for cls in _classes(base):
            own = vars(cls).get("__init__")
            if own is not None or cls is base:
                patched.append((cls, own))
                cls.__init__ = counting(cls, own)
    found = []
    try:
        yield found
    finally:
        for cls, own in patched:
            if own is None:
                del cls.__init__
            else:
                cls.__init__ = own
        found.extend(created.values())
