"""GET /metrics (Prometheus text format) and the per-request log line."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_app.http.metrics import IngressMetrics, RecordingStream
from tests.support.serve_fixtures import TINY_MODEL_ID
from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.worker_info import WorkerStats

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHAT = "/v1/chat/completions"
SECRET_PROMPT = "my secret prompt: the launch code is 0000"
MESSAGES = [{"role": "user", "content": SECRET_PROMPT}]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of GET /metrics, keyed by (sample name, sorted labels)."""
    resp = httpx.get(url + "/metrics", timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def post(url: str, body) -> httpx.Response:
    return httpx.post(url + CHAT, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=60)


def test_metrics_count_what_was_sent(tiny_app):
    before = scrape(tiny_app)

    ok = post(tiny_app, {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 4, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    usage = ok.json()["usage"]
    assert usage["completion_tokens"] == 4

    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", tiny_app + CHAT, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    stream_usage = json.loads(events[-2])["usage"]
    assert stream_usage["completion_tokens"] == 3

    bad = post(tiny_app, {"model": TINY_MODEL_ID, "messages": MESSAGES, "temperature": 7})
    assert bad.status_code == 400
    missing = post(tiny_app, {"model": "no-such-model", "messages": MESSAGES})
    assert missing.status_code == 404

    after = scrape(tiny_app)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    requests = "chatserve_requests_total"
    assert moved(requests, route=CHAT, model=TINY_MODEL_ID, status="200") == 2
    # A model name the server does not serve is client input: it never becomes a label value.
    assert moved(requests, route=CHAT, model="", status="400") == 1
    assert moved(requests, route=CHAT, model="", status="404") == 1
    assert not any(dict(labels).get("model") == "no-such-model" for _, labels in after)

    assert moved("chatserve_prompt_tokens_total", model=TINY_MODEL_ID) == \
        usage["prompt_tokens"] + stream_usage["prompt_tokens"]
    assert moved("chatserve_completion_tokens_total", model=TINY_MODEL_ID) == 4 + 3

    assert moved("chatserve_time_to_first_token_seconds_count", model=TINY_MODEL_ID) == 2
    assert moved("chatserve_time_to_first_token_seconds_sum", model=TINY_MODEL_ID) > 0
    assert moved("chatserve_queue_time_seconds_count", model=TINY_MODEL_ID) == 2
    assert moved("chatserve_time_per_output_token_seconds_count", model=TINY_MODEL_ID) == 2
    assert moved("chatserve_e2e_request_latency_seconds_count", route=CHAT, model=TINY_MODEL_ID) == 2
    assert moved("chatserve_e2e_request_latency_seconds_count", route=CHAT, model="") == 2
    assert value(after, "chatserve_e2e_request_latency_seconds_bucket", route=CHAT, model=TINY_MODEL_ID,
                 le="+Inf") == value(after, "chatserve_e2e_request_latency_seconds_count", route=CHAT,
                                     model=TINY_MODEL_ID)

    # Gauges: read from the worker at scrape time; nothing is running between requests.
    assert ("chatserve_running_sequences", (("model", TINY_MODEL_ID),)) in after
    assert ("chatserve_waiting_sequences", (("model", TINY_MODEL_ID),)) in after
    ratio = value(after, "chatserve_kv_cache_usage_ratio", model=TINY_MODEL_ID)
    assert 0.0 <= ratio <= 1.0
    assert ("chatserve_kv_cache_usage_ratio", (("model", TINY_MODEL_ID),)) in after


def test_other_routes_are_counted_under_their_own_route(tiny_app):
    before = scrape(tiny_app)
    resp = httpx.post(tiny_app + "/v1/completions", json={"model": TINY_MODEL_ID, "prompt": "hi", "max_tokens": 2},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    after = scrape(tiny_app)
    labels = dict(route="/v1/completions", model=TINY_MODEL_ID, status="200")
    assert value(after, "chatserve_requests_total", **labels) - value(before, "chatserve_requests_total",
                                                                      **labels) == 1



def test_a_stream_the_client_leaves_counts_as_499(tiny_app):
    labels = dict(route=CHAT, model=TINY_MODEL_ID, status="499")
    before = value(scrape(tiny_app), "chatserve_requests_total", **labels)
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "stream": True, "max_tokens": 200, "ignore_eos": True}
    with httpx.stream("POST", tiny_app + CHAT, json=body, timeout=60) as resp:
        assert next(resp.iter_lines()).startswith("data: ")
    # The ingress learns of the disconnect a moment after the client closes.
    deadline = time.time() + 20
    while value(scrape(tiny_app), "chatserve_requests_total", **labels) - before < 1 and time.time() < deadline:
        time.sleep(0.2)
    assert value(scrape(tiny_app), "chatserve_requests_total", **labels) - before == 1

# -- unit: the record and its log line --------------------------------------------------


class _FakeWorkerStream:
    def __init__(self, chunks):
        self.chunks = list(chunks)
        self.cancelled = False

    async def __anext__(self):
        if not self.chunks:
            raise StopAsyncIteration
        return self.chunks.pop(0)

    def cancel(self):
        self.cancelled = True


def _finished_record(metrics: IngressMetrics, status: int = 200):
    import asyncio

    class Req:
        model = TINY_MODEL_ID
        stream = True
        messages = MESSAGES  # what a record must never copy

    record = metrics.begin(CHAT)
    record.set_request(Req())
    record.request_id = "chatcmpl-test"
    chunks = [GenerationChunk(text=SECRET_PROMPT, prompt_tokens=9, completion_tokens=1, prefill_time_ms=12.5),
              GenerationChunk(text=SECRET_PROMPT, prompt_tokens=9, completion_tokens=3, decode_times_ms=[2.0, 4.0],
                              finish_reason="length")]
    stream = RecordingStream(_FakeWorkerStream(chunks), record)

    async def drain():
        return [c async for c in stream]

    assert len(asyncio.run(drain())) == 2
    record.finish(status)
    record.finish(status)  # idempotent: observed and logged once
    return record


def test_log_line_has_no_prompt_text(caplog):
    metrics = IngressMetrics([TINY_MODEL_ID])
    with caplog.at_level(logging.INFO, logger="chatserve.requests"):
        _finished_record(metrics)
    lines = [r for r in caplog.records if r.name == "chatserve.requests"]
    assert len(lines) == 1
    assert SECRET_PROMPT not in caplog.text and "launch code" not in caplog.text
    line = json.loads(lines[0].getMessage())
    assert line == {"request_id": "chatcmpl-test", "route": CHAT, "model": TINY_MODEL_ID, "status": 200,
                    "stream": True, "prompt_tokens": 9, "completion_tokens": 3, "ttft_ms": 12.5, "queue_ms": None, "tpot_ms": 3.0,
                    "e2e_ms": line["e2e_ms"]}
    assert line["e2e_ms"] >= 0
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics.exposition().decode()) for s in f.samples}
    assert value(samples, "chatserve_requests_total", route=CHAT, model=TINY_MODEL_ID, status="200") == 1
    assert value(samples, "chatserve_completion_tokens_total", model=TINY_MODEL_ID) == 3
    assert value(samples, "chatserve_time_per_output_token_seconds_sum", model=TINY_MODEL_ID) == pytest.approx(0.003)


def test_debug_log_adds_details_but_still_no_text(caplog):
    metrics = IngressMetrics([TINY_MODEL_ID])
    with caplog.at_level(logging.DEBUG, logger="chatserve.requests"):
        record = _finished_record(metrics, status=499)
    line = json.loads([r for r in caplog.records if r.name == "chatserve.requests"][0].getMessage())
    assert line["status"] == 499 and line["finish_reasons"] == ["length"]
    assert SECRET_PROMPT not in caplog.text
    assert record.finished


def test_errors_and_unknown_models_get_an_empty_model_label(caplog):
    metrics = IngressMetrics([TINY_MODEL_ID])

    class Req:
        model = "someone-typed-this"
        stream = False

    record = metrics.begin(CHAT)
    record.set_request(Req())
    record.add(GenerationChunk(error=ErrorInfo(400, "too long")))
    with caplog.at_level(logging.INFO, logger="chatserve.requests"):
        record.fail(404, "invalid_request_error", "The model `someone-typed-this` does not exist")
    line = json.loads(caplog.records[-1].getMessage())
    assert line["model"] == "" and line["status"] == 404 and line["error_type"] == "invalid_request_error"
    assert "someone-typed-this" not in caplog.text  # the message is DEBUG-only


def test_kv_usage_gauge():
    metrics = IngressMetrics([TINY_MODEL_ID])
    metrics.set_worker_gauges(TINY_MODEL_ID, WorkerStats(active_requests=2, waiting=1, running=1,
                                                         kv_blocks_used=3, kv_blocks_total=12, engine_steps=5,
                                                         prefix_cache_query_tokens=200, prefix_cache_hit_tokens=50))
    text = metrics.exposition().decode()
    assert 'chatserve_kv_cache_usage_ratio{model="tiny-llama"} 0.25' in text
    assert 'chatserve_prefix_cache_hit_ratio{model="tiny-llama"} 0.25' in text
    assert 'chatserve_waiting_sequences{model="tiny-llama"} 1.0' in text


def test_speculative_decoding_gauges():
    metrics = IngressMetrics([TINY_MODEL_ID])
    metrics.set_worker_gauges(TINY_MODEL_ID, WorkerStats(active_requests=1, waiting=0, running=1,
                                                         kv_blocks_used=3, kv_blocks_total=12, engine_steps=9,
                                                         spec_drafts=4, spec_draft_tokens=12, spec_accepted_tokens=6))
    text = metrics.exposition().decode()
    assert 'chatserve_spec_decode_draft_tokens{model="tiny-llama"} 12.0' in text
    assert 'chatserve_spec_decode_accepted_tokens{model="tiny-llama"} 6.0' in text
    assert 'chatserve_spec_decode_tokens_per_step{model="tiny-llama"} 2.5' in text


def test_resumed_counter_follows_the_transport_count():
    metrics = IngressMetrics([TINY_MODEL_ID])

    def resumed() -> list[float]:
        families = text_string_to_metric_families(metrics.exposition().decode())
        return [s.value for f in families for s in f.samples if s.name == "chatserve_requests_resumed_total"]

    assert resumed() == []
    metrics.count_resumes({TINY_MODEL_ID: 0})
    assert resumed() == [0]  # a reader can tell "none yet" from a server without the counter
    metrics.count_resumes({TINY_MODEL_ID: 3})
    metrics.count_resumes({TINY_MODEL_ID: 3})  # a second scrape with no new resume adds nothing
    assert resumed() == [3]
    metrics.count_resumes({TINY_MODEL_ID: 5})
    assert resumed() == [5]
