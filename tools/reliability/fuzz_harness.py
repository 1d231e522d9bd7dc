"""Send fuzz cases (tools/reliability/fuzz_bodies.py) to a running chatserve and judge the answers.

An answer is a problem when it is a 5xx, a 4xx without an OpenAI-shaped error body, a
200 that is not a well-formed completion (JSON) or stream (SSE ending in `data: [DONE]`,
with no error event), or no answer within the timeout. The report also counts the
status codes; the callers compare the worker replicas and engine state before and after.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from tools.reliability.fuzz_bodies import FuzzCase

REQUEST_TIMEOUT_S = 120


@dataclass(frozen=True)
class Outcome:
    case: FuzzCase
    status: int  # 0: no answer (timeout or connection error)
    problem: str | None


@dataclass
class FuzzReport:
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def statuses(self) -> Counter:
        return Counter(o.status for o in self.outcomes)

    @property
    def server_errors(self) -> int:
        return sum(o.status >= 500 for o in self.outcomes)

    @property
    def problems(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problem]

    def by_kind(self) -> dict[str, Counter]:
        table: dict[str, Counter] = {}
        for o in self.outcomes:
            table.setdefault(o.case.kind, Counter())[o.status] += 1
        return dict(sorted(table.items()))

    def describe_problems(self, limit: int = 20) -> str:
        lines = [f"{o.status} {o.case.kind} {o.case.route}: {o.problem} | body {o.case.body[:200]!r}"
                 for o in self.problems[:limit]]
        return "\n".join(lines)


def run_cases(base_url: str, cases: list[FuzzCase], concurrency: int = 4) -> FuzzReport:
    """Send every case (`concurrency` at a time, so the engine batches them)."""
    start = time.monotonic()
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client, \
            ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(lambda case: send(client, case), cases))
    return FuzzReport(outcomes, time.monotonic() - start)


def send(client: httpx.Client, case: FuzzCase) -> Outcome:
    try:
        resp = client.post(case.route, content=case.body, headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:
        return Outcome(case, 0, f"no answer: {type(exc).__name__}")
    return Outcome(case, resp.status_code, check_response(resp))


def check_response(resp: httpx.Response) -> str | None:
    if resp.status_code >= 500:
        return f"server error: {resp.text[:300]}"
    if resp.status_code >= 400:
        return check_error_body(resp.text)
    if resp.status_code != 200:
        return f"unexpected status {resp.status_code}"
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        return check_sse(resp.text)
    return check_completion(resp.text)


def check_error_body(text: str) -> str | None:
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"error body is not OpenAI-shaped: {text[:200]!r}"
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"error object has the wrong fields: {error!r}"[:300]
    if not isinstance(error["message"], str) or not error["message"]:
        return "error without a message"
    return None


def check_completion(text: str) -> str | None:
    try:
        body = json.loads(text)
    except ValueError:
        return f"200 body is not JSON: {text[:200]!r}"
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices or not isinstance(body.get("usage"), dict):
        return f"200 body without choices or usage: {text[:200]!r}"
    if any(c.get("finish_reason") is None for c in choices):
        return "a choice without finish_reason"
    return None


def check_sse(text: str) -> str | None:
    events = [line for line in text.split("\n") if line]
    if not events or events[-1] != "data: [DONE]":
        return f"stream does not end with data: [DONE]: {text[-200:]!r}"
    for event in events[:-1]:
        if not event.startswith("data: "):
            return f"not an SSE data line: {event[:200]!r}"
        try:
            payload = json.loads(event[len("data: "):])
        except ValueError:
            return f"SSE event is not JSON: {event[:200]!r}"
        if "error" in payload:
            return f"error event in the stream: {json.dumps(payload)[:300]}"
        if not isinstance(payload.get("choices"), list):
            return f"SSE event without choices: {event[:200]!r}"
    return None


# ------------------------------------------------------------------ server-side state

def replica_actor_names(app_name: str) -> set[str]:
    """The Serve replica actors of an app: a restarted replica comes back under a new name."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#"
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def wait_idle(stats_fn, timeout: float = 30):
    """The worker's stats once no request is active (cancelled streams finish freeing
    their sequences a moment after the client has its answer)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = stats_fn()
        if (stats.active_requests == 0 and stats.running == 0 and stats.waiting == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)
