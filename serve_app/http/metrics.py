"""Prometheus metrics and the per-request log line of an ingress replica.

Each `ChatIngress` replica owns one `IngressMetrics` with a private `CollectorRegistry`
(so two apps in one process, or the tests, never share series), served by `GET /metrics`.

A generation request gets a `RequestRecord` when `_parse` starts (route known, model
not yet); the model label is set only once the model is known to be served (an unknown
model name is client input and would make the label set unbounded, so it stays "").
The record is finished exactly once: by `_generate` (non-streaming), by the SSE
generator's end (streaming: 200, or 499 when the client left first, 500 on an
exception), or by the APIError / 500 handler for any error before the response began.
Finishing observes the histograms, adds the token counters and writes one JSON line to
the `chatserve.requests` logger. Nothing is observed per chunk: `RecordingStream`
only keeps the first-token time, a running decode-time sum and the last chunk.

The current record travels in a ContextVar: `_parse`, `_generate` and the exception
handlers all run in the request's own task.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from collections.abc import Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from workers.contract.chunks import GenerationChunk
from workers.contract.serve_logs import route_to_serve_log
from workers.contract.worker_info import WorkerStats

request_logger = logging.getLogger("chatserve.requests")
logger = logging.getLogger("chatserve.metrics")

CONTENT_TYPE = CONTENT_TYPE_LATEST
STATUS_CLIENT_GONE = 499  # nginx's "client closed request": a stream the client left before its end
STATS_TIMEOUT_S = 2.0

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("chatserve_request", default=None)


def current_record() -> RequestRecord | None:
    """The record of the request this task serves, if `_parse` started one."""
    return _current.get()


def route_request_log_to_serve() -> None:
    """In a Serve replica, write `chatserve.requests` to the replica's Serve log at INFO
    (workers/contract/serve_logs.py says why it would go nowhere otherwise)."""
    route_to_serve_log(request_logger)


class IngressMetrics:
    def __init__(self, served_models: list[str] | None = None, disaggregated: list[str] | None = None) -> None:
        """`disaggregated`: the models served by a prefill and a decode deployment (their
        worker gauges describe the decode side, also given as its `chatserve_pd_*` series)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.served = frozenset(served_models or ())
        self.disaggregated = frozenset(disaggregated or ())
        r = self.registry
        self.requests = Counter("chatserve_requests", "Generation requests by route, model and HTTP status",
                                ["route", "model", "status"], registry=r)
        self.ttft = Histogram("chatserve_time_to_first_token_seconds",
                              "Time to first token as measured by the worker (includes its queue time)",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.queue_time = Histogram("chatserve_queue_time_seconds",
                                    "Time a request waited in the worker's engine before its first model step",
                                    ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("chatserve_time_per_output_token_seconds",
                              "Mean time per output token after the first, one observation per request",
                              ["model"], buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("chatserve_e2e_request_latency_seconds",
                             "Ingress time from the request's arrival to its last byte (or error)",
                             ["route", "model"], buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("chatserve_prompt_tokens", "Prompt tokens of finished requests",
                                     ["model"], registry=r)
        self.completion_tokens = Counter("chatserve_completion_tokens", "Generated tokens of finished requests",
                                         ["model"], registry=r)
        self.running = Gauge("chatserve_running_sequences", "Sequences in the running batch (one worker replica)",
                             ["model"], registry=r)
        self.waiting = Gauge("chatserve_waiting_sequences", "Sequences waiting to be scheduled (one worker replica)",
                             ["model"], registry=r)
        self.kv_usage = Gauge("chatserve_kv_cache_usage_ratio", "KV cache blocks used / total (one worker replica)",
                              ["model"], registry=r)
        self.prefix_hit = Gauge("chatserve_prefix_cache_hit_ratio",
                                "Prompt tokens found in the prefix cache / prompt tokens looked up, since the "
                                "worker replica started", ["model"], registry=r)
        self.resumed = Counter("chatserve_requests_resumed",
                               "Resumes of requests on another worker replica by this ingress replica (one per "
                               "attempt: a request that lost two replicas, or had to try twice, counts twice)",
                               ["model"], registry=r)
        self._resumes_seen: dict[str, int] = {}
        # Speculative decoding, per worker replica since it started (0 with speculation off).
        self.spec_draft_tokens = Gauge("chatserve_spec_decode_draft_tokens", "Tokens proposed by speculative "
                                       "decoding (one worker replica, since it started)", ["model"], registry=r)
        self.spec_accepted_tokens = Gauge("chatserve_spec_decode_accepted_tokens", "Proposed tokens the model "
                                          "accepted (one worker replica, since it started)", ["model"], registry=r)
        self.spec_tokens_per_step = Gauge("chatserve_spec_decode_tokens_per_step", "Mean tokens a verification "
                                          "step gave its sequence: 1 + accepted / verifications (one worker "
                                          "replica, since it started)", ["model"], registry=r)
        # Disaggregated models (prefill/decode): each side's queue and KV, and the hand-overs.
        self.side_running = Gauge("chatserve_pd_running_sequences", "Sequences in the running batch of one worker "
                                  "replica of a disaggregated model's side", ["model", "side"], registry=r)
        self.side_waiting = Gauge("chatserve_pd_waiting_sequences", "Sequences waiting to be scheduled on one worker "
                                  "replica of a disaggregated model's side", ["model", "side"], registry=r)
        self.side_kv_usage = Gauge("chatserve_pd_kv_cache_usage_ratio", "KV cache blocks used / total of one worker "
                                   "replica of a disaggregated model's side", ["model", "side"], registry=r)
        self.handoffs = Gauge("chatserve_kv_handoffs", "Requests whose prompt KV blocks one decode replica took from "
                              "a prefill replica, since it started", ["model"], registry=r)
        self.transfer_bytes = Gauge("chatserve_kv_transfer_bytes_per_request", "Mean KV bytes a hand-over moved "
                                    "(one decode replica, since it started)", ["model"], registry=r)
        self.transfer_ms = Gauge("chatserve_kv_transfer_ms_per_request", "Mean milliseconds a hand-over took to "
                                 "move and write its KV blocks (one decode replica, since it started)", ["model"],
                                 registry=r)

    # -- requests -------------------------------------------------------------------

    def begin(self, route: str, counted: bool = True) -> RequestRecord:
        """Start the record of a request and make it this task's current one; one not
        `counted` (a tokenizer route's, kept only for its spans) is neither observed nor logged."""
        record = RequestRecord(self, route, counted)
        _current.set(record)
        return record

    def model_label(self, model: object) -> str:
        return model if isinstance(model, str) and model in self.served else ""

    def observe(self, rec: RequestRecord) -> None:
        model = rec.model
        self.requests.labels(rec.route, model, str(rec.status)).inc()
        self.e2e.labels(rec.route, model).observe(rec.e2e_s)
        if rec.ttft_ms is not None:
            self.ttft.labels(model).observe(rec.ttft_ms / 1000)
        if rec.queue_ms is not None:
            self.queue_time.labels(model).observe(rec.queue_ms / 1000)
        if rec.decode_count:
            self.tpot.labels(model).observe(rec.decode_sum_ms / rec.decode_count / 1000)
        if rec.prompt_tokens:
            self.prompt_tokens.labels(model).inc(rec.prompt_tokens)
        if rec.completion_tokens:
            self.completion_tokens.labels(model).inc(rec.completion_tokens)

    # -- scrape ---------------------------------------------------------------------

    def count_resumes(self, resumes: Mapping[str, int]) -> None:
        """Bring the resumed counter up to each model's transport count (`WorkerChannels.resumes`,
        read at scrape time: the transport stays free of metrics code and a resume costs nothing more)."""
        for model, total in resumes.items():
            counter = self.resumed.labels(model)  # the series exists at 0 before any resume
            added = total - self._resumes_seen.get(model, 0)
            if added > 0:
                counter.inc(added)
                self._resumes_seen[model] = total

    async def refresh_worker_gauges(self, stats_of: Mapping[str, object]) -> None:
        """Set the gauges from each model's `stats` (awaitables keyed by model id, e.g.
        `handle.stats.remote()`). A worker that does not answer in time loses its series."""
        ids = list(stats_of)
        results = await asyncio.gather(
            *(asyncio.wait_for(_awaited(stats_of[m]), STATS_TIMEOUT_S) for m in ids), return_exceptions=True
        )
        for model, stats in zip(ids, results):
            if isinstance(stats, WorkerStats):
                self.set_worker_gauges(model, stats)
            else:
                logger.warning("stats of model %s unavailable: %r", model, stats)
                for gauge in (self.running, self.waiting, self.kv_usage, self.prefix_hit, self.spec_draft_tokens,
                              self.spec_accepted_tokens, self.spec_tokens_per_step):
                    try:
                        gauge.remove(model)
                    except KeyError:
                        pass

    def set_worker_gauges(self, model: str, stats: WorkerStats) -> None:
        self.running.labels(model).set(stats.running)
        self.waiting.labels(model).set(stats.waiting)
        total = stats.kv_blocks_total
        self.kv_usage.labels(model).set(stats.kv_blocks_used / total if total > 0 else 0.0)
        queried = stats.prefix_cache_query_tokens
        self.prefix_hit.labels(model).set(stats.prefix_cache_hit_tokens / queried if queried > 0 else 0.0)
        self.spec_draft_tokens.labels(model).set(stats.spec_draft_tokens)
        self.spec_accepted_tokens.labels(model).set(stats.spec_accepted_tokens)
        drafts = stats.spec_drafts
        self.spec_tokens_per_step.labels(model).set(1 + stats.spec_accepted_tokens / drafts if drafts else 0.0)
        if model in self.disaggregated:
            self._set_side_gauges(model, "decode", stats)

    async def refresh_prefill_gauges(self, stats_of: Mapping[str, object]) -> None:
        """Set the prefill side's `chatserve_pd_*` gauges from its `stats` (awaitables keyed by
        model id; the decode side's come with the worker gauges); a side that does not answer
        keeps its last values."""
        for model, pending in stats_of.items():
            try:
                stats = await asyncio.wait_for(_awaited(pending), STATS_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a scrape never fails for one worker
                logger.warning("stats of model %s (prefill side) unavailable: %r", model, exc)
                continue
            self._set_side_gauges(model, "prefill", stats)

    def _set_side_gauges(self, model: str, side: str, stats: WorkerStats) -> None:
        self.side_running.labels(model, side).set(stats.running)
        self.side_waiting.labels(model, side).set(stats.waiting)
        total = stats.kv_blocks_total
        self.side_kv_usage.labels(model, side).set(stats.kv_blocks_used / total if total > 0 else 0.0)
        if side == "decode":
            received = stats.kv_handoffs_received
            self.handoffs.labels(model).set(received)
            self.transfer_bytes.labels(model).set(stats.kv_transfer_bytes / received if received else 0.0)
            self.transfer_ms.labels(model).set(stats.kv_transfer_ms / received if received else 0.0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


async def _awaited(value):
    return await value


class RequestRecord:
    """What one request's metrics and log line need; filled cheaply, observed once."""

    __slots__ = ("metrics", "route", "model", "request_id", "stream", "start", "status", "ttft_ms",
                 "decode_sum_ms", "decode_count", "queue_ms", "prompt_tokens", "completion_tokens", "error_type",
                 "error_message", "finish_reasons", "e2e_s", "finished", "trace", "counted")

    def __init__(self, metrics: IngressMetrics, route: str, counted: bool = True) -> None:
        self.metrics = metrics
        self.route = route
        self.counted = counted
        self.model = ""
        self.request_id: str | None = None
        self.stream = False
        self.start = time.perf_counter()
        self.status = 0
        self.ttft_ms: float | None = None
        self.decode_sum_ms = 0.0
        self.decode_count = 0
        self.queue_ms: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.error_type: str | None = None
        self.error_message: str | None = None
        self.finish_reasons: list[str] = []
        self.e2e_s = 0.0
        self.finished = False
        self.trace = None  # the request's spans (serve_app/http/tracing.py), when traced

    def set_request(self, req: object) -> None:
        """After validation: the model (if served) and the stream flag."""
        self.model = self.metrics.model_label(getattr(req, "model", None))
        self.stream = bool(getattr(req, "stream", False))

    def add(self, chunk: GenerationChunk) -> None:
        """One worker chunk: only what is needed at the end (O(1) but for decode_times_ms)."""
        if chunk.prefill_time_ms is not None and self.ttft_ms is None:
            self.ttft_ms = chunk.prefill_time_ms
        if chunk.queue_time_ms is not None and self.queue_ms is None:
            self.queue_ms = chunk.queue_time_ms
        times = chunk.decode_times_ms
        if times:
            self.decode_sum_ms += sum(times)
            self.decode_count += len(times)
        # Usage in a chunk is per request (all choices) and a running total.
        if chunk.prompt_tokens:
            self.prompt_tokens = chunk.prompt_tokens
        if chunk.completion_tokens > self.completion_tokens:
            self.completion_tokens = chunk.completion_tokens
        if chunk.finish_reason is not None:
            self.finish_reasons.append(chunk.finish_reason)
        if chunk.error is not None and self.error_type is None:
            # After the response began: the status stays the HTTP one (200); the log says why.
            self.error_type = chunk.error.type
            self.error_message = chunk.error.message

    def fail(self, status: int, error_type: str | None, message: str | None = None) -> None:
        self.error_type = error_type
        self.error_message = message
        self.finish(status)

    def finish(self, status: int) -> None:
        if self.finished:
            return
        self.finished = True
        self.status = status
        self.e2e_s = time.perf_counter() - self.start
        try:
            if self.counted:
                self.metrics.observe(self)
            if self.counted and request_logger.isEnabledFor(logging.INFO):
                request_logger.info(self.log_line())
        except Exception:  # metrics must never fail a request
            logger.exception("recording request metrics failed")
        if self.trace is not None:
            try:
                self.trace.finish(self)
            except Exception:  # nor must tracing
                logger.exception("ending the request's spans failed")

    def log_line(self) -> str:
        """One JSON object: no prompt or output text, no keys, no client-supplied strings.
        At DEBUG the finish reasons and the error message are added."""
        line = {
            "request_id": self.request_id,
            "route": self.route,
            "model": self.model,
            "status": self.status,
            "stream": self.stream,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 3),
            "queue_ms": None if self.queue_ms is None else round(self.queue_ms, 3),
            "tpot_ms": round(self.decode_sum_ms / self.decode_count, 3) if self.decode_count else None,
            "e2e_ms": round(self.e2e_s * 1000, 3),
        }
        if self.error_type is not None:
            line["error_type"] = self.error_type
        if request_logger.isEnabledFor(logging.DEBUG):
            line["finish_reasons"] = self.finish_reasons
            if self.error_message is not None:
                line["error_message"] = self.error_message
        return json.dumps(line, separators=(",", ":"))


class RecordingStream:
    """Wraps the worker's response generator: each chunk goes to the record on its way;
    `cancel()` reaches the real call."""

    __slots__ = ("_stream", "_record")

    def __init__(self, stream, record: RequestRecord) -> None:
        self._stream = stream
        self._record = record

    def __aiter__(self) -> RecordingStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        chunk = await self._stream.__anext__()
        self._record.add(chunk)
        return chunk

    def cancel(self) -> None:
        self._stream.cancel()
