"""The worker's spans of a traced request (workers/serving/request_trace.py): built from a
finished request's timings under the ingress's trace context, from the chunks a request
puts in its outbox, and by the request processor itself on the tiny model; without the
config, or for a request the ingress did not trace, no tracer or span is created."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest
from opentelemetry.trace import SpanKind, StatusCode

from tests.support.engines import chat_request, generate, make_engine, with_async_engine
from tests.support.tracing import (
    CLIENT_SPAN_ID,
    CLIENT_TRACE_ID,
    TRACEPARENT,
    MemoryTracing,
    otel_objects_created,
)
from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.continuation import ChoiceProgress, Continuation
from workers.contract.tracing import TracingConfig
from workers.serving.request_processor import RequestProcessor
from workers.serving.request_trace import (
    RequestTiming,
    WorkerTracing,
    record_spans,
)

CONTEXT = {"traceparent": TRACEPARENT}
WALL_END_NS = 1_700_000_000_000_000_000  # the wall clock when the fake request ended (perf_counter 10.0)


def ns(perf: float) -> int:
    return WALL_END_NS - round((10.0 - perf) * 1e9)


def finished(**fields) -> RequestTiming:
    """A request that arrived at perf_counter 2.0, was admitted at 2.01, queued 0.09 s,
    had its first token at 2.5 and its last at 9.5, and ended at 10.0."""
    base = {"request_id": "chatcmpl-1", "arrival": 2.0, "end": 10.0, "end_wall_ns": WALL_END_NS, "admitted": 2.01,
            "queue_s": 0.09, "first_token": 2.5, "last_token": 9.5, "decode_tokens": 7, "decode_s": 7.0,
            "prompt_tokens": 12, "completion_tokens": 8, "cached_tokens": 4, "finish_reasons": ["length"]}
    return RequestTiming(**{**base, **fields})


def test_a_finished_request_becomes_a_worker_span_with_its_phases_under_the_ingress_span():
    memory = MemoryTracing()
    record_spans(memory.tracer("chatserve.worker"), CONTEXT, "tiny", "colocated", finished())
    spans = memory.spans()
    assert set(spans) == {"chatserve.worker", "chatserve.admit", "chatserve.queue", "chatserve.prefill",
                          "chatserve.decode"}
    worker = spans["chatserve.worker"]
    assert worker.kind is SpanKind.SERVER
    assert worker.context.trace_id == CLIENT_TRACE_ID and worker.parent.span_id == CLIENT_SPAN_ID
    assert worker.parent.is_remote
    for name in ("chatserve.admit", "chatserve.queue", "chatserve.prefill", "chatserve.decode"):
        assert spans[name].parent.span_id == worker.context.span_id, name
        assert spans[name].context.trace_id == CLIENT_TRACE_ID
    times = {name: (s.start_time, s.end_time) for name, s in spans.items()}
    assert times == {"chatserve.worker": (ns(2.0), ns(10.0)), "chatserve.admit": (ns(2.0), ns(2.01)),
                     "chatserve.queue": (ns(2.01), ns(2.1)), "chatserve.prefill": (ns(2.1), ns(2.5)),
                     "chatserve.decode": (ns(2.5), ns(9.5))}
    assert dict(worker.attributes) == {
        "chatserve.request_id": "chatcmpl-1", "gen_ai.request.model": "tiny", "chatserve.worker.side": "colocated",
        "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 8, "chatserve.resumed": False,
        "chatserve.handed_off": False, "chatserve.kv_received": False, "chatserve.cancelled": False,
        "gen_ai.response.finish_reasons": ("length",), "chatserve.cached_tokens": 4}
    assert worker.status.status_code is StatusCode.UNSET
    assert dict(spans["chatserve.prefill"].attributes) == {"gen_ai.usage.input_tokens": 12,
                                                           "chatserve.cached_tokens": 4}
    assert dict(spans["chatserve.decode"].attributes) == {"chatserve.decode.tokens": 7,
                                                          "chatserve.decode.mean_token_ms": 1000.0}


def test_a_refused_request_has_only_its_admission_and_an_error_status():
    memory = MemoryTracing()
    error = ErrorInfo(400, "the prompt is longer than the window", param="messages", code="context_length_exceeded")
    timing = finished(queue_s=None, first_token=None, last_token=None, decode_tokens=0, completion_tokens=0,
                      cached_tokens=None, finish_reasons=[], error=error, end=2.02)
    record_spans(memory.tracer("chatserve.worker"), CONTEXT, "tiny", "colocated", timing)
    spans = memory.spans()
    assert set(spans) == {"chatserve.worker", "chatserve.admit"}
    worker = spans["chatserve.worker"]
    assert worker.status.status_code is StatusCode.ERROR and worker.status.description == "invalid_request_error"
    assert (worker.attributes["error.type"], worker.attributes["chatserve.error.status"],
            worker.attributes["chatserve.error.code"]) == ("invalid_request_error", 400, "context_length_exceeded")
    assert "the prompt" not in str(dict(worker.attributes))  # messages may quote the client's input


def test_a_single_token_answer_has_no_decode_span_and_a_queue_never_ends_after_the_first_token():
    memory = MemoryTracing()
    timing = finished(queue_s=5.0, first_token=2.5, last_token=2.5, decode_tokens=0, decode_s=0.0)
    record_spans(memory.tracer("chatserve.worker"), CONTEXT, "tiny", "colocated", timing)
    spans = memory.spans()
    assert "chatserve.decode" not in spans
    assert spans["chatserve.queue"].end_time == spans["chatserve.prefill"].start_time == ns(2.5)


class ListOutbox:
    """Just the outbox's interface, keeping what was put."""

    def __init__(self) -> None:
        self.put_chunks: list[tuple[str, GenerationChunk]] = []
        self.forgotten: list[tuple[str, int]] = []

    def put(self, request_id: str, chunk: GenerationChunk) -> None:
        self.put_chunks.append((request_id, chunk))

    def forget(self, request_id: str, num_choices: int) -> None:
        self.forgotten.append((request_id, num_choices))

    def drop(self, request_id: str) -> None:
        pass

    def receipt(self, request_id: str) -> str:
        return f"receipt of {request_id}"


def test_the_chunks_of_two_choices_give_first_and_last_token_times_queue_and_usage():
    memory = MemoryTracing()
    tracing = WorkerTracing(memory.tracer("chatserve.worker"), "tiny", "decode")
    request = dataclasses.replace(chat_request("Hi", 4, n=2), trace_context=CONTEXT)
    outbox = ListOutbox()
    traced = tracing.begin(request, outbox, arrival=100.0)
    chunks = [  # choice 1's first token comes first; each chunk as the worker's choices time them
        GenerationChunk(index=1, token_ids=[5], prefill_time_ms=300.0, queue_time_ms=50.0, prompt_tokens=9,
                        completion_tokens=1, cached_tokens=0),
        GenerationChunk(index=0, token_ids=[6], prefill_time_ms=310.0, prompt_tokens=9, completion_tokens=2),
        GenerationChunk(index=0, token_ids=[7, 8], decode_times_ms=[20.0, 30.0], prompt_tokens=9,
                        completion_tokens=4),
        GenerationChunk(index=1, token_ids=[9, 10, 11], decode_times_ms=[10.0, 10.0, 100.0], finish_reason="length",
                        prompt_tokens=9, completion_tokens=7),
        GenerationChunk(index=0, token_ids=[12], decode_times_ms=[5.0], finish_reason="stop", stop_reason=12,
                        prompt_tokens=9, completion_tokens=8),
    ]
    with traced:
        traced.admitted()
        for chunk in chunks:
            traced.put("r", chunk)
        traced.put("other", GenerationChunk(index=0, finish_reason="stop"))  # another request's: passed on only
        traced.forget("r", 2)
        assert traced.receipt("r") == "receipt of r"  # the rest of the outbox's interface, unchanged
    assert outbox.put_chunks == [("r", c) for c in chunks] + [("other", GenerationChunk(finish_reason="stop"))]
    assert outbox.forgotten == [("r", 2)]
    timing = traced.timing
    assert (timing.queue_s, timing.prompt_tokens, timing.completion_tokens, timing.cached_tokens) == (0.05, 9, 8, 0)
    assert timing.finish_reasons == ["length", "stop"]
    assert timing.first_token == pytest.approx(100.3)
    assert timing.last_token == pytest.approx(100.3 + 0.12)  # choice 1: 300 + 120 ms; choice 0: 310 + 55 ms
    assert (timing.decode_tokens, timing.decode_s) == (6, pytest.approx(0.175))
    spans = memory.spans()
    worker = spans["chatserve.worker"]
    assert worker.attributes["chatserve.worker.side"] == "decode"
    assert worker.attributes["gen_ai.response.finish_reasons"] == ("length", "stop")
    assert worker.end_time - worker.start_time == round((timing.end - 100.0) * 1e9)
    decode = spans["chatserve.decode"]
    assert decode.end_time - decode.start_time == pytest.approx(120e6, abs=1e3)


def test_a_resumed_choice_times_its_first_new_token_by_its_first_gap():
    memory = MemoryTracing()
    tracing = WorkerTracing(memory.tracer("chatserve.worker"), "tiny")
    resume = Continuation((ChoiceProgress((5, 6)),))
    request = dataclasses.replace(chat_request("Hi", 8), trace_context=CONTEXT, resume=resume)
    traced = tracing.begin(request, ListOutbox(), arrival=0.0)
    with traced:
        traced.admitted()
        traced.put("r", GenerationChunk(token_ids=[7], decode_times_ms=[40.0], queue_time_ms=1.0, completion_tokens=3))
        traced.put("r", GenerationChunk(token_ids=[8], decode_times_ms=[25.0], completion_tokens=4,
                                        finish_reason="stop"))
    assert traced.timing.first_token == pytest.approx(0.04)
    assert traced.timing.last_token == pytest.approx(0.065)
    assert traced.timing.decode_tokens == 1
    assert memory.spans()["chatserve.worker"].attributes["chatserve.resumed"] is True


def test_a_cancelled_or_failed_run_still_ends_its_spans():
    memory = MemoryTracing()
    tracing = WorkerTracing(memory.tracer("chatserve.worker"), "tiny")
    request = dataclasses.replace(chat_request("Hi", 8), trace_context=CONTEXT)
    with pytest.raises(asyncio.CancelledError), tracing.begin(request, ListOutbox(), arrival=0.0):
        raise asyncio.CancelledError
    spans = memory.spans()
    assert set(spans) == {"chatserve.worker", "chatserve.admit"}
    assert spans["chatserve.worker"].attributes["chatserve.cancelled"] is True
    assert spans["chatserve.worker"].status.status_code is StatusCode.UNSET
    memory = MemoryTracing()
    tracing = WorkerTracing(memory.tracer("chatserve.worker"), "tiny")
    with pytest.raises(KeyError), tracing.begin(request, ListOutbox(), arrival=0.0):
        raise KeyError("bug")
    worker = memory.spans()["chatserve.worker"]
    assert worker.status.status_code is StatusCode.ERROR and worker.attributes["error.type"] == "KeyError"


def test_a_request_without_a_trace_context_is_not_followed():
    memory = MemoryTracing()
    tracing = WorkerTracing(memory.tracer("chatserve.worker"), "tiny")
    outbox = ListOutbox()
    assert tracing.begin(chat_request("Hi", 8), outbox, arrival=0.0) is None


def test_without_an_endpoint_the_worker_builds_no_tracing():
    with otel_objects_created() as created:
        assert WorkerTracing.from_config(None, "tiny") is None
        assert WorkerTracing.from_config({"service_name": "x"}, "tiny") is None
        assert WorkerTracing.from_config(TracingConfig(), "tiny") is None
    assert created == []


def run_processor(paged_model, tiny_tokenizer, tracing: WorkerTracing | None, trace_context) -> list[GenerationChunk]:
    request = dataclasses.replace(chat_request("Hi there", 5, ignore_eos=True, n=2), trace_context=trace_context)

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer, tracing=tracing)
        return [c async for c in generate(processor, request)]

    return asyncio.run(with_async_engine(make_engine(paged_model, max_model_len=256), body))


def test_the_request_processor_writes_the_spans_of_a_traced_request(paged_model, tiny_tokenizer):
    memory = MemoryTracing()
    tracing = WorkerTracing(memory.tracer("chatserve.worker"), "tiny")
    chunks = run_processor(paged_model, tiny_tokenizer, tracing, CONTEXT)
    assert chunks[-1].completion_tokens == 10 and all(c.error is None for c in chunks)
    spans = memory.spans()
    worker = spans["chatserve.worker"]
    assert worker.parent.span_id == CLIENT_SPAN_ID
    assert (worker.attributes["gen_ai.usage.output_tokens"], worker.attributes["gen_ai.usage.input_tokens"]) == (
        10, chunks[0].prompt_tokens)
    assert worker.attributes["gen_ai.response.finish_reasons"] == ("length", "length")
    phases = [spans[n] for n in ("chatserve.admit", "chatserve.queue", "chatserve.prefill", "chatserve.decode")]
    assert all(p.parent.span_id == worker.context.span_id for p in phases)
    assert phases[-1].attributes["chatserve.decode.tokens"] == 8  # 4 a choice after its first
    # In order, each within the worker span: admit, queue, prefill, decode.
    assert worker.start_time == phases[0].start_time
    for earlier, later in itertools.pairwise(phases):
        assert earlier.end_time <= later.start_time + 1000, (earlier.name, later.name)  # µs of clock rounding
    assert phases[-1].end_time <= worker.end_time


@pytest.mark.parametrize("configured", [False, True], ids=["tracing off", "tracing on, request not traced"])
def test_no_tracer_or_span_is_created_for_a_request_that_is_not_traced(paged_model, tiny_tokenizer, configured):
    """Off: the processor holds no WorkerTracing, even for a request that carries a context;
    on, a request the ingress did not sample (no context) costs nothing either. The count
    is real: the same request traced creates spans."""
    tracing = WorkerTracing(MemoryTracing().tracer("chatserve.worker"), "tiny") if configured else None
    with otel_objects_created() as created:
        chunks = run_processor(paged_model, tiny_tokenizer, tracing, None if configured else CONTEXT)
    assert chunks[-1].completion_tokens == 10
    assert created == []
    with otel_objects_created() as created:
        run_processor(paged_model, tiny_tokenizer, WorkerTracing(MemoryTracing().tracer("w"), "tiny"), CONTEXT)
    assert len(created) >= 5
