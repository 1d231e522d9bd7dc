"""Soak: a bounded closed loop of mixed requests against chatserve, every request classified.

    python -m tools.reliability.soak --config configs/default.yaml --duration 600 --concurrency 32
    python -m tools.reliability.soak --url http://127.0.0.1:8000 --duration 60     # a running server

Each of `concurrency` clients sends one request after another until `duration` is over,
each request one of KINDS (chosen at random, seeded). Every request ends in exactly one
class: `completed` (HTTP 200 and a well-formed body or SSE stream), `failed` (a clear
error: a status with an OpenAI-shaped JSON error, or an SSE error event before `[DONE]`)
or `lost` (connection error, timeout, malformed body or stream: the target is 0).

Before the load and after it (once the worker is idle again) the worker is probed:
running / waiting sequences, KV blocks in use and the replica's RSS (its `stats`). A freed block stays
in the prefix cache but sits in the free pool (workers/engine/block_manager.py), so "in use"
means referenced by a live sequence: the baseline of an idle worker is 0 in use, and a
soak that ends above it has leaked a sequence.

Chaos (`--worker-replicas 2 --kill-worker-every 60`): beside the load, one worker replica
is killed every S seconds (`ray.kill`, no restart: tools/reliability/replicas.py); the
next kill comes S seconds after the last one or once Serve has all the deployment's
replicas RUNNING again, whichever is later, so a kill never lands on a deployment still
short of a replica (the kills test resuming, not running with no replica at all). The
report adds the kills, the resumes the ingress counted (`chatserve_requests_resumed_total`
of its `/metrics`, read before and after the load: one ingress replica answers it, so with
several this is that replica's share) and the longest pause a streaming client saw: the
largest gap between its request's start, its SSE events and the stream's end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from tools.reliability.replicas import (
    kill_replica,
    running_replicas,
    wait_all_running,
    wait_replaced,
    with_worker_replicas,
    worker_replicas_of,
)
from tools.servers import wait_ready

KINDS = ("chat_stream", "chat", "chat_n", "tool_call", "completion", "disconnect")
COMPLETED, FAILED, LOST = "completed", "failed", "lost"
RESUMED = "chatserve_requests_resumed_total"  # serve_app/http/metrics.py
CHAT_FINISH = {"stop", "length", "tool_calls"}

PROMPTS = (
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "List three colours.",
    "Explain what a hash table is.",
    "Tell me a fact about owls.",
)
# Seed 001's tool (tests/serve/test_conformance_seeds.py), forced so the call path is exercised.
DELIVERY_TOOL = {
    "type": "function",
    "function": {
        "name": "get_delivery_date",
        "strict": True,
        "description": "Get the delivery date for a customer's order.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string", "description": "The customer's order ID."}},
            "required": ["order_id"],
            "additionalProperties": False,
        },
    },
}
TOOL_MESSAGES = [
    {"role": "system", "content": "You are a helpful customer support assistant. Use the supplied tools."},
    {"role": "user", "content": "Hi, can you tell me the delivery date for my order? my order id is 12345."},
]


@dataclass
class Outcome:
    kind: str
    result: str  # COMPLETED | FAILED | LOST
    status: int | None  # HTTP status (None: no response)
    detail: str = ""  # error code or why it was lost
    completion_tokens: int = 0
    latency_s: float = 0.0
    started: float = 0.0  # time.monotonic() at send
    tool_calls: int = 0
    longest_pause_s: float | None = None  # streams only: PauseClock.longest
    pause_began: float | None = None  # time.monotonic() when that pause began


class Malformed(Exception):
    """The server answered 200 with something that is not a valid response."""


# --------------------------------------------------------------------------- requests


def request_for(kind: str, model: str, max_tokens: int, rng: random.Random) -> tuple[str, dict]:
    """(path, body) of one request of `kind`; streams ask for usage (the token count)."""
    path, body = _request_for(kind, model, max_tokens, rng)
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    return path, body


def _request_for(kind: str, model: str, max_tokens: int, rng: random.Random) -> tuple[str, dict]:
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    temperature = rng.choice([0.0, 0.7, 1.0])
    chat = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    if kind == "chat":
        return "/v1/chat/completions", chat
    if kind in ("chat_stream", "disconnect"):
        return "/v1/chat/completions", {**chat, "stream": True}
    if kind == "chat_n":
        return "/v1/chat/completions", {**chat, "n": rng.choice([2, 3]), "temperature": 0.8,
                                        "stream": rng.random() < 0.5}
    if kind == "tool_call":
        choice = rng.choice(["required", {"type": "function", "function": {"name": "get_delivery_date"}}])
        return "/v1/chat/completions", {"model": model, "messages": TOOL_MESSAGES, "tools": [DELIVERY_TOOL],
                                        "tool_choice": choice, "max_tokens": max(max_tokens, 48),
                                        "temperature": temperature, "stream": rng.random() < 0.5}
    if kind == "completion":
        return "/v1/completions", {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens,
                                   "temperature": temperature, "stream": rng.random() < 0.5}
    raise ValueError(f"unknown kind {kind!r}")


def error_detail(payload: object) -> str | None:
    """The error code (or type) of an OpenAI-shaped error object with a message, else None."""
    if not isinstance(payload, dict) or not isinstance(payload.get("error"), dict):
        return None
    err = payload["error"]
    if not isinstance(err.get("message"), str) or not err["message"]:
        return None
    return str(err.get("code") or err.get("type") or "error")


def check_body(path: str, body: dict, payload: dict) -> tuple[int, int]:
    """(completion tokens, tool calls) of a well-formed non-streaming response; raises Malformed."""
    choices = payload.get("choices")
    n = body.get("n", 1)
    if not isinstance(choices, list) or sorted(c.get("index") for c in choices) != list(range(n)):
        raise Malformed(f"choices {choices!r:.200}")
    calls = 0
    for choice in choices:
        if choice.get("finish_reason") not in CHAT_FINISH:
            raise Malformed(f"finish_reason {choice.get('finish_reason')!r}")
        if path == "/v1/completions":
            if not isinstance(choice.get("text"), str):
                raise Malformed("completion without text")
            continue
        message = choice.get("message") or {}
        calls += len(message.get("tool_calls") or [])
        # A forced tool call that the length cap cut is neither content nor a call (null content,
        # no tool_calls): a valid answer, but only when the cap ended it.
        if not isinstance(message.get("content"), str) and not message.get("tool_calls") \
                and choice.get("finish_reason") != "length":
            raise Malformed("message with neither content nor tool_calls")
    usage = payload.get("usage") or {}
    tokens = usage.get("completion_tokens")
    if not isinstance(tokens, int) or tokens < 1:
        raise Malformed(f"usage {usage!r}")
    return tokens, calls


@dataclass
class StreamState:
    """What a stream said so far; a stream is complete when every choice finished, then [DONE]."""

    n: int
    finished: set[int] = field(default_factory=set)
    chunks: int = 0
    tokens: int = 0
    tool_calls: int = 0
    error: str | None = None
    done: bool = False

    def feed(self, line: str) -> None:
        if not line:
            return
        if not line.startswith("data: ") or self.done:
            raise Malformed(f"unexpected SSE line {line!r:.200}")
        if line == "data: [DONE]":
            self.done = True
            return
        payload = json.loads(line[6:])
        if self.error is not None:
            raise Malformed("an event after the error event")
        if "error" in payload:
            self.error = error_detail(payload)
            if self.error is None:
                raise Malformed(f"error event without a message {payload!r:.200}")
            return
        self.chunks += 1
        if payload.get("usage"):
            self.tokens = payload["usage"].get("completion_tokens") or self.tokens
        for choice in payload.get("choices") or []:
            delta = choice.get("delta") or {}
            self.tool_calls += len(delta.get("tool_calls") or [])
            if choice.get("finish_reason") is not None:
                if choice["finish_reason"] not in CHAT_FINISH:
                    raise Malformed(f"finish_reason {choice['finish_reason']!r}")
                self.finished.add(choice["index"])

    def complete(self) -> bool:
        return self.done and self.error is None and self.finished == set(range(self.n))


@dataclass
class PauseClock:
    """The longest gap a streaming client waited: request start -> first event, event ->
    event, last event -> the stream's end (a stream cut after a silence counts that silence)."""

    last: float  # time.monotonic() of the request's start, then of each event
    longest: float = 0.0
    began: float = field(init=False)  # when the longest gap began

    def __post_init__(self) -> None:
        self.began = self.last

    def tick(self, now: float) -> None:
        if now - self.last > self.longest:
            self.longest, self.began = now - self.last, self.last
        self.last = now


async def send(client: httpx.AsyncClient, base_url: str, kind: str, path: str, body: dict,
               disconnect_after: int) -> Outcome:
    """One request, classified. Timeouts are the client's (a hang is lost)."""
    start = time.monotonic()
    outcome = Outcome(kind, LOST, None, started=start)
    try:
        if body.get("stream"):
            await _stream(client, base_url + path, body, outcome, disconnect_after if kind == "disconnect" else 0)
        else:
            resp = await client.post(base_url + path, json=body)
            outcome.status = resp.status_code
            payload = _json(resp.content)
            if resp.status_code == 200:
                outcome.completion_tokens, outcome.tool_calls = check_body(path, body, payload)
                outcome.result = COMPLETED
            else:
                _classify_error(outcome, payload)
    except httpx.TimeoutException as exc:
        outcome.detail = f"timeout: {type(exc).__name__}"
    except httpx.HTTPError as exc:
        outcome.detail = f"connection: {type(exc).__name__}: {exc}"[:300]
    except (Malformed, ValueError) as exc:  # ValueError: invalid JSON
        outcome.result, outcome.detail = LOST, f"malformed: {exc}"[:300]
    outcome.latency_s = time.monotonic() - start
    return outcome


async def _stream(client: httpx.AsyncClient, url: str, body: dict, outcome: Outcome, disconnect_after: int) -> None:
    clock = PauseClock(outcome.started)
    try:
        await _read_stream(client, url, body, outcome, disconnect_after, clock)
    finally:  # also when the stream broke: the silence before it counts
        if outcome.status == 200:
            clock.tick(time.monotonic())
            outcome.longest_pause_s, outcome.pause_began = clock.longest, clock.began


async def _read_stream(client: httpx.AsyncClient, url: str, body: dict, outcome: Outcome, disconnect_after: int,
                       clock: PauseClock) -> None:
    async with client.stream("POST", url, json=body) as resp:
        outcome.status = resp.status_code
        if resp.status_code != 200:
            _classify_error(outcome, _json(await resp.aread()))
            return
        state = StreamState(body.get("n", 1))
        async for line in resp.aiter_lines():
            if line:  # the blank line after each event arrives with it
                clock.tick(time.monotonic())
            state.feed(line)
            if disconnect_after and state.chunks >= disconnect_after:
                outcome.result, outcome.detail = COMPLETED, "disconnected"
                return  # leaving the block closes the connection mid-stream
        outcome.completion_tokens, outcome.tool_calls = state.tokens, state.tool_calls
        if state.error is not None and state.done:
            outcome.result, outcome.detail = FAILED, state.error
        elif state.complete():
            outcome.result = COMPLETED
        else:
            raise Malformed(f"stream ended early: done={state.done} finished={sorted(state.finished)}")


def _json(content: bytes) -> dict:
    payload = json.loads(content)
    if not isinstance(payload, dict):
        raise Malformed(f"body {content[:200]!r}")
    return payload


def _classify_error(outcome: Outcome, payload: dict) -> None:
    detail = error_detail(payload)
    if detail is None:
        raise Malformed(f"HTTP {outcome.status} without an error message: {payload!r:.200}")
    outcome.result, outcome.detail = FAILED, detail


# --------------------------------------------------------------------------- probe


@dataclass
class WorkerSnapshot:
    running: int
    waiting: int
    active_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    rss_mib: float | None  # the worker replica's resident memory (None where it cannot tell)

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.active_requests == 0


class ServeProbe:
    """Reads one model's worker through its Serve `stats` handle (the driver must be attached
    to the Ray cluster): sequences, KV blocks, and the replica's own RSS."""

    def __init__(self, app_name: str, model_id: str) -> None:
        from ray import serve

        from serve_app.app import worker_deployment_name

        self.handle = serve.get_deployment_handle(worker_deployment_name(model_id), app_name=app_name)

    def snapshot(self) -> WorkerSnapshot:
        stats = self.handle.stats.remote().result(timeout_s=60)
        rss = round(stats.rss_bytes / 2**20, 1) if stats.rss_bytes else None
        return WorkerSnapshot(stats.running, stats.waiting, stats.active_requests, stats.kv_blocks_used,
                              stats.kv_blocks_total, rss)

    def rss_mib(self) -> float | None:
        return self.snapshot().rss_mib


async def settled(probe: ServeProbe, baseline: WorkerSnapshot | None, timeout_s: float) -> tuple[WorkerSnapshot, float]:
    """Poll until the worker is idle with no more KV blocks in use than `baseline` (none
    given: just idle), or the timeout; returns the last snapshot and the seconds it took.
    Idle needs a moment even with no load: a client that hung up is noticed by the
    ingress, which then cancels the worker call."""
    start = time.monotonic()
    while True:
        snap = await asyncio.to_thread(probe.snapshot)
        back = snap.idle and (baseline is None or snap.kv_blocks_used <= baseline.kv_blocks_used)
        if back or time.monotonic() - start > timeout_s:
            return snap, round(time.monotonic() - start, 1)
        await asyncio.sleep(0.5)


# --------------------------------------------------------------------------- chaos


@dataclass
class Kill:
    at_s: float  # seconds after the load began
    replica: str  # the killed replica's actor name
    replaced_s: float | None  # kill -> the deployment's replicas all RUNNING again (None: not in time)


@dataclass
class WorkerKiller:
    """Kills one replica of a worker deployment every `every_s` seconds of the load (the
    first after `first_s`, default `every_s`); each next kill also waits for the last one's
    replacement (the module docstring says why)."""

    app_name: str
    deployment: str
    every_s: float
    first_s: float | None = None
    replace_timeout_s: float = 180  # the default model's replica loads in ~20 s on 2 cores

    def ready(self, timeout_s: float = 180) -> int:
        """Wait until every replica is RUNNING; returns how many. Refuses fewer than two:
        the killed replica's requests need another one to resume on."""
        replicas = running_replicas(self.app_name, self.deployment)[1]
        if replicas < 2:
            raise ValueError(f"chaos needs at least 2 worker replicas, {self.deployment} has {replicas}: "
                             "a kill would leave no replica to resume its requests on")
        wait_all_running(self.app_name, self.deployment, replicas, timeout_s)
        return replicas

    async def run(self, duration_s: float, replicas: int) -> list[Kill]:
        """The kills over `duration_s` from now; returns once the last one's replacement is up."""
        start = time.monotonic()
        next_at = start + (self.every_s if self.first_s is None else self.first_s)
        kills: list[Kill] = []
        while next_at < start + duration_s:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            killed_at = time.monotonic()
            kills.append(await asyncio.to_thread(self._kill_one, start, replicas))
            if kills[-1].replaced_s is None:
                break  # never kill a deployment still short of a replica
            next_at = max(killed_at + self.every_s, time.monotonic())
        return kills

    def _kill_one(self, start: float, replicas: int) -> Kill:
        at = time.monotonic()
        killed = kill_replica(self.app_name, self.deployment)
        replaced = wait_replaced(self.app_name, self.deployment, killed, replicas, at, self.replace_timeout_s)
        return Kill(round(at - start, 1), killed, replaced)


def resumes_counted(url: str, model: str) -> int | None:
    """The ingress's resume count for `model` (`GET /metrics`); None where it cannot be read
    (a server older than the counter, or one that wants an API key)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = httpx.get(url + "/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:  # e.g. a server with API keys: the soak sends none
        return None
    values = [sample.value for family in text_string_to_metric_families(resp.text) for sample in family.samples
              if sample.name == RESUMED and sample.labels.get("model") == model]
    return int(sum(values)) if values else None


@dataclass
class ChaosResult:
    every_s: float
    worker_replicas: int
    kills: list[Kill]


# --------------------------------------------------------------------------- the loop


@dataclass
class SoakConfig:
    url: str
    model: str
    concurrency: int = 32
    duration_s: float = 600
    max_tokens: int = 32
    request_timeout_s: float = 300  # a request still unanswered then is lost (a hang)
    settle_timeout_s: float = 60
    seed: int = 0
    kinds: tuple[str, ...] = KINDS


@dataclass
class SoakReport:
    config: dict
    date: str
    wall_s: float
    requests: int
    completed: int
    failed: int
    lost: int
    by_kind: dict[str, dict[str, int]]
    failures: dict[str, int]  # error code -> count
    lost_details: list[str]
    status_counts: dict[str, int]
    completion_tokens: int
    output_tok_s: float
    tool_calls: int
    latency_p50_s: float
    latency_p99_s: float
    before: dict | None
    peak_rss_mib: float | None
    rss_samples_mib: list[float]  # every 10 s during the load, then after it: growth or a plateau
    after: dict | None
    settle_s: float | None
    back_to_baseline: bool | None
    chaos: dict | None  # ChaosResult: the interval, the replicas, each kill
    kills: int
    resumes: int | None  # counted by the ingress during the load (None: not readable)
    streams_timed: int  # streaming requests that got a 200, whose pauses are below
    longest_pause_s: float | None  # the longest gap any of them waited (PauseClock)
    longest_pause_at_s: float | None  # when that gap began, seconds after the load began
    longest_completed_pause_s: float | None  # the same over completed streams: a failed one's wait is not a resume's
    pause_p99_s: float | None  # p99 over the streams of each one's longest gap

    def summary(self) -> str:
        lines = [f"soak {self.wall_s:.0f} s at concurrency {self.config['concurrency']}: {self.requests} requests, "
                 f"{self.completed} completed, {self.failed} failed with a clear error, {self.lost} lost",
                 f"  {self.completion_tokens} completion tokens, {self.output_tok_s:.1f} tok/s, "
                 f"latency p50 {self.latency_p50_s:.2f} s p99 {self.latency_p99_s:.2f} s, tool calls {self.tool_calls}"]
        lines.append(f"  longest pause a streaming client saw {self.longest_pause_s} s (began at "
                     f"{self.longest_pause_at_s} s), p99 of each stream's longest {self.pause_p99_s} s, "
                     f"over {self.streams_timed} streams; longest in a completed stream "
                     f"{self.longest_completed_pause_s} s; resumes counted by the ingress {self.resumes}")
        if self.chaos is not None:
            kills = ", ".join(f"at {k['at_s']} s replaced in {k['replaced_s']} s" for k in self.chaos["kills"])
            lines.append(f"  chaos: {self.kills} worker replica kills of {self.chaos['worker_replicas']}, "
                         f"every {self.chaos['every_s']} s: {kills or 'none'}")
        for kind, counts in sorted(self.by_kind.items()):
            lines.append(f"  {kind:<12} " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        if self.failures:
            lines.append(f"  failures: {self.failures}")
        for detail in self.lost_details[:10]:
            lines.append(f"  lost: {detail}")
        if self.before is not None:
            lines.append(f"  worker before: {self.before}")
            lines.append(f"  worker after ({self.settle_s} s later): {self.after}; peak RSS {self.peak_rss_mib} MiB")
            lines.append(f"  back to baseline: {self.back_to_baseline}; RSS every 10 s: {self.rss_samples_mib}")
        return "\n".join(lines)


async def run_load(config: SoakConfig, on_sample: Callable[[], None] | None = None) -> tuple[list[Outcome], float]:
    """The closed loop: every client sends until the duration is over; returns the outcomes
    and the wall time. `on_sample` is called every 10 s (e.g. to record RSS)."""
    rng = random.Random(config.seed)
    seeds = [rng.randrange(2**32) for _ in range(config.concurrency)]
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30)
    outcomes: list[Outcome] = []
    start = time.monotonic()
    deadline = start + config.duration_s

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def client_loop(seed: int) -> None:
            crng = random.Random(seed)
            while time.monotonic() < deadline:
                kind = crng.choice(config.kinds)
                path, body = request_for(kind, config.model, config.max_tokens, crng)
                outcomes.append(await send(client, config.url, kind, path, body, crng.randint(1, 4)))

        async def sampler() -> None:
            while on_sample is not None and time.monotonic() < deadline:
                await asyncio.to_thread(on_sample)
                await asyncio.sleep(10)

        await asyncio.gather(sampler(), *(client_loop(s) for s in seeds))
    return outcomes, time.monotonic() - start


async def soak(config: SoakConfig, probe: ServeProbe | None = None, killer: WorkerKiller | None = None) -> SoakReport:
    """The load (with `killer`'s kills beside it), the worker probed before and after it."""
    replicas = await asyncio.to_thread(killer.ready) if killer else 0
    before = (await settled(probe, None, config.settle_timeout_s))[0] if probe else None
    resumes_before = await asyncio.to_thread(resumes_counted, config.url, config.model)
    rss: list[float] = []

    def sample() -> None:
        value = probe.rss_mib() if probe else None
        if value is not None:
            rss.append(value)

    kills = asyncio.create_task(killer.run(config.duration_s, replicas)) if killer else None
    outcomes, wall = await run_load(config, sample if probe else None)
    chaos = ChaosResult(killer.every_s, replicas, await kills) if killer else None
    after, settle_s = await settled(probe, before, config.settle_timeout_s) if probe else (None, None)
    if after is not None and after.rss_mib is not None:
        rss.append(after.rss_mib)
    resumes_after = await asyncio.to_thread(resumes_counted, config.url, config.model)
    resumes = None if resumes_before is None or resumes_after is None else resumes_after - resumes_before
    return report(config, outcomes, wall, before, after, settle_s, rss, chaos, resumes)


@dataclass
class Pauses:
    streams: int
    longest_s: float | None
    longest_at_s: float | None  # seconds after the first request began
    p99_s: float | None
    longest_completed_s: float | None  # over the completed streams only


def pauses(outcomes: list[Outcome]) -> Pauses:
    """The longest pause over all timed streams, when it began, and the p99 of each stream's longest."""
    timed = [o for o in outcomes if o.longest_pause_s is not None]
    if not timed:
        return Pauses(0, None, None, None, None)
    worst = max(timed, key=lambda o: o.longest_pause_s)
    load_start = min(o.started for o in outcomes)
    completed = [o.longest_pause_s for o in timed if o.result == COMPLETED]
    return Pauses(len(timed), round(worst.longest_pause_s, 2), round(worst.pause_began - load_start, 1),
                  round(_quantile(sorted(o.longest_pause_s for o in timed), 0.99), 2),
                  round(max(completed), 2) if completed else None)


def report(config: SoakConfig, outcomes: list[Outcome], wall: float, before: WorkerSnapshot | None,
           after: WorkerSnapshot | None, settle_s: float | None, rss_samples: list[float],
           chaos: ChaosResult | None = None, resumes: int | None = None) -> SoakReport:
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.result] += 1
    results = Counter(o.result for o in outcomes)
    latencies = sorted(o.latency_s for o in outcomes if o.result == COMPLETED and o.detail != "disconnected")
    tokens = sum(o.completion_tokens for o in outcomes if o.result == COMPLETED)
    paused = pauses(outcomes)
    back = None
    if before is not None and after is not None:
        back = after.idle and after.kv_blocks_used <= before.kv_blocks_used
    return SoakReport(
        config=asdict(config), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), wall_s=round(wall, 1),
        requests=len(outcomes), completed=results[COMPLETED], failed=results[FAILED], lost=results[LOST],
        by_kind={k: dict(v) for k, v in by_kind.items()},
        failures=dict(Counter(f"{o.status} {o.detail}" for o in outcomes if o.result == FAILED)),
        lost_details=[f"{o.kind} status={o.status} {o.detail}" for o in outcomes if o.result == LOST][:50],
        status_counts=dict(Counter(str(o.status) for o in outcomes)),
        completion_tokens=tokens, output_tok_s=round(tokens / wall, 1) if wall else 0.0,
        tool_calls=sum(o.tool_calls for o in outcomes),
        latency_p50_s=round(_quantile(latencies, 0.5), 2), latency_p99_s=round(_quantile(latencies, 0.99), 2),
        before=asdict(before) if before else None, after=asdict(after) if after else None,
        peak_rss_mib=max(rss_samples, default=None), rss_samples_mib=rss_samples, settle_s=settle_s,
        back_to_baseline=back, chaos=asdict(chaos) if chaos else None, kills=len(chaos.kills) if chaos else 0,
        resumes=resumes, streams_timed=paused.streams, longest_pause_s=paused.longest_s,
        longest_pause_at_s=paused.longest_at_s, pause_p99_s=paused.p99_s,
        longest_completed_pause_s=paused.longest_completed_s,
    )


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


# --------------------------------------------------------------------------- starting the app


def app_args(config_path: str, worker_replicas: int | None = None) -> dict:
    """The config's first application's args, with `worker_replicas` replicas of its first
    model if given (one torch thread and half a CPU each: tools/reliability/replicas.py)."""
    import yaml

    with open(config_path) as f:
        args = yaml.safe_load(f)["applications"][0]["args"]
    return args if worker_replicas is None else with_worker_replicas(args, worker_replicas)


def start_app(args: dict, app_name: str = "chatserve", port: int = 8000) -> tuple[str, str]:
    """Start Ray, Serve and an application of these args on loopback; returns (url, model id)."""
    import ray
    from ray import serve

    from serve_app.app import build_app

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name=app_name, route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url)
    return url, args["models"][0]["id"]


def stop_app() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def warm_up(url: str, model: str, max_tokens: int) -> None:
    """One request of each kind before the baseline, so first-use allocations are not counted as growth."""
    rng = random.Random(1)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            for kind in KINDS:
                path, body = request_for(kind, model, max_tokens, rng)
                await send(client, url, kind, path, body, 2)

    asyncio.run(run())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml", help="start this config's first app")
    parser.add_argument("--url", default=None, help="use a running server instead (no worker probe, no chaos)")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=600, help="seconds of load")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--request-timeout", type=float, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker-replicas", type=int, default=None,
                        help="replicas of the config's first model (each then one torch thread, half a CPU)")
    parser.add_argument("--kill-worker-every", type=float, default=None, metavar="S",
                        help="chaos: kill a worker replica every S seconds of the load (needs 2+ replicas)")
    parser.add_argument("--json", default="bench-results/soak.json")
    args = parser.parse_args(argv)
    if args.kill_worker_every is not None:
        if args.url is not None:
            parser.error("--kill-worker-every kills replicas of the app it starts: leave out --url")
        replicas = args.worker_replicas or worker_replicas_of(app_args(args.config))
        if replicas < 2:
            parser.error(f"--kill-worker-every needs at least 2 worker replicas (has {replicas}): "
                         "add --worker-replicas 2, so the killed replica's requests have one to resume on")
    return args


def main(argv: list[str] | None = None) -> None:
    from serve_app.app import worker_deployment_name

    args = parse_args(argv)
    started = args.url is None
    url, model = start_app(app_args(args.config, args.worker_replicas)) if started else (args.url, None)
    try:
        model = args.model or model or httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        probe = ServeProbe("chatserve", model) if started else None
        killer = None if args.kill_worker_every is None else \
            WorkerKiller("chatserve", worker_deployment_name(model), args.kill_worker_every)
        warm_up(url, model, args.max_tokens)
        config = SoakConfig(url=url, model=model, concurrency=args.concurrency, duration_s=args.duration,
                            max_tokens=args.max_tokens, request_timeout_s=args.request_timeout, seed=args.seed)
        result = asyncio.run(soak(config, probe, killer))
    finally:
        if started:
            stop_app()
    print(result.summary(), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**asdict(result), "worker_replicas": args.worker_replicas,
                       "machine": f"{os.cpu_count()} CPU cores"}, f, indent=2)


if __name__ == "__main__":
    main()
