"""Faults under load: kill a model-worker replica, or the ingress replica, while clients stream.

    python -m tools.reliability.faults --config configs/default.yaml --json bench-results/faults.json

Starts the config's first app with two worker replicas (so a worker kill can show that
only the requests on the killed replica fail; `--ingress-replicas 2` does the same for
the ingress), runs a closed loop of streaming chat
requests, kills one replica (`ray.kill`, no restart: Serve's controller must notice and
replace it) and keeps the load going. Per fault it reports:

- in flight at the kill, and of those the affected ones (not completed), by class:
  `failed` (a clear error: JSON error or SSE error event) or `lost` (cut connection,
  malformed, timeout);
- failures among requests sent after the kill, and among those sent once the edge could
  know of it (`EDGE_NOTICE_S` after): until Serve's proxy drops the dead replica from its
  set it still routes new requests there, answered 500 or cut (the streams the kill cut
  come straight back, their clients sending again);
- recovery: seconds from the kill until a probe request (one token, sent one after
  another beside the load, not counted in it) sent after the kill succeeds; and until
  Serve reports the deployment's replicas all RUNNING again, the killed one replaced.

The third fault of docs/RELIABILITY.md, an exception inside one request's sampling, is
an engine-level fault and is tested in tests/reliability/test_faults.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from tools.reliability.replicas import (
    kill_replica,
    running_replicas,
    wait_all_running,
    wait_replaced,
    with_worker_replicas,
)
from tools.reliability.soak import COMPLETED, FAILED, LOST, Outcome, send

INGRESS = "ChatIngress"
# How long after a kill a new request may still be routed to the dead replica: Serve's
# proxy drops it from its set when a call to it fails or the controller's update arrives
# (0.3-0.5 s in the runs of docs/RELIABILITY.md).
EDGE_NOTICE_S = 1.0


@dataclass
class FaultLoad:
    url: str
    model: str
    concurrency: int = 8
    max_tokens: int = 64
    kill_after_s: float = 10  # load before the kill
    run_after_s: float = 40  # load after the kill
    request_timeout_s: float = 120


@dataclass
class FaultReport:
    fault: str
    replicas: int  # of the killed deployment
    in_flight_at_kill: int
    affected: int  # of those, not completed
    affected_failed: int
    affected_lost: int
    sent_after_kill: int
    failed_after_kill: int  # failed or lost
    failed_after_notice: int  # of those, sent EDGE_NOTICE_S or more after the kill
    recovery_s: float | None  # kill -> the end of the first probe sent after it that succeeded
    replaced_s: float | None  # kill -> the deployment's replicas all RUNNING again
    errors: dict[str, int]  # "class detail" -> count, over affected and later failures

    def line(self) -> str:
        return (f"{self.fault}: {self.affected} of {self.in_flight_at_kill} in flight affected "
                f"({self.affected_failed} failed clearly, {self.affected_lost} lost); "
                f"{self.failed_after_kill} of {self.sent_after_kill} sent after the kill failed "
                f"({self.failed_after_notice} from {EDGE_NOTICE_S} s after it); "
                f"recovery {self.recovery_s} s, replica replaced in {self.replaced_s} s; {self.errors}")


async def load_with_kill(load: FaultLoad, kill: Callable[[], None]) -> tuple[list[Outcome], list[Outcome], float]:
    """The closed loop of streaming requests, and beside it a probe loop of one-token
    requests; calls `kill()` (in a thread) after kill_after_s and returns once both the
    load and `kill()` are done. Returns the load's outcomes, the probes' and the monotonic
    time of the kill."""
    body = {"model": load.model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": load.max_tokens, "temperature": 0.7, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    probe = {"model": load.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    outcomes: list[Outcome] = []
    probes: list[Outcome] = []
    start = time.monotonic()
    deadline = start + load.kill_after_s + load.run_after_s
    killed_at: list[float] = []
    timeout = httpx.Timeout(load.request_timeout_s, connect=30)
    limits = httpx.Limits(max_connections=load.concurrency + 1)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def client_loop(kind: str, request: dict, into: list[Outcome]) -> None:
            while time.monotonic() < deadline:
                outcome = await send(client, load.url, kind, "/v1/chat/completions", dict(request), 0)
                into.append(outcome)
                if outcome.result != COMPLETED or kind == "probe":
                    await asyncio.sleep(0.2)  # a refused request comes back at once: do not spin

        async def killer() -> None:
            await asyncio.sleep(load.kill_after_s)
            killed_at.append(time.monotonic())
            await asyncio.to_thread(kill)

        await asyncio.gather(killer(), client_loop("probe", probe, probes),
                             *(client_loop("chat_stream", body, outcomes) for _ in range(load.concurrency)))
    return outcomes, probes, killed_at[0]


def fault_report(fault: str, replicas: int, outcomes: list[Outcome], probes: list[Outcome], killed_at: float,
                 replaced_s: float | None) -> FaultReport:
    in_flight = [o for o in outcomes if o.started < killed_at < o.started + o.latency_s]
    affected = [o for o in in_flight if o.result != COMPLETED]
    after = [o for o in outcomes if o.started >= killed_at]
    failed_after = [o for o in after if o.result != COMPLETED]
    return FaultReport(
        fault=fault, replicas=replicas, in_flight_at_kill=len(in_flight), affected=len(affected),
        affected_failed=sum(o.result == FAILED for o in affected),
        affected_lost=sum(o.result == LOST for o in affected),
        sent_after_kill=len(after), failed_after_kill=len(failed_after),
        failed_after_notice=sum(o.started >= killed_at + EDGE_NOTICE_S for o in failed_after),
        recovery_s=recovery_seconds(probes, killed_at), replaced_s=replaced_s,
        errors=dict(_count(f"{o.result} {o.status} {o.detail[:80]}" for o in affected + failed_after)),
    )


def recovery_seconds(probes: list[Outcome], killed_at: float) -> float | None:
    """Kill -> the end of the first probe sent after it that succeeded (None: none did)."""
    ok = [o.started + o.latency_s for o in probes if o.started >= killed_at and o.result == COMPLETED]
    return round(min(ok) - killed_at, 1) if ok else None


def _count(items) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def run_fault(fault: str, app_name: str, deployment: str, load: FaultLoad) -> FaultReport:
    """One fault: load, kill a replica of `deployment` mid-load, measure, wait for the replacement."""
    replicas = running_replicas(app_name, deployment)[1]  # of any state: the target
    replaced: list[float | None] = []

    def kill() -> None:  # runs in a thread while the load goes on
        since = time.monotonic()
        killed = kill_replica(app_name, deployment)
        replaced.append(wait_replaced(app_name, deployment, killed, replicas, since, load.run_after_s + 120))

    wait_all_running(app_name, deployment, replicas, timeout_s=120)
    outcomes, probes, killed_at = asyncio.run(load_with_kill(load, kill))
    return fault_report(fault, replicas, outcomes, probes, killed_at, replaced[0])


# --------------------------------------------------------------------------- command line


def fault_app_args(args: dict, worker_replicas: int, ingress_replicas: int) -> dict:
    """The app's args with `worker_replicas` replicas of the first model (one torch thread
    and half a CPU each: tools/reliability/replicas.py) and `ingress_replicas`."""
    args = with_worker_replicas(args, worker_replicas)
    args.setdefault("ingress", {})["num_replicas"] = ingress_replicas
    return args


def main(argv: list[str] | None = None) -> None:
    import ray
    import yaml
    from ray import serve

    from serve_app.app import build_app, worker_deployment_name
    from tools.servers import wait_ready

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--worker-replicas", type=int, default=2)
    parser.add_argument("--ingress-replicas", type=int, default=1, help="the config's own is 1")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kill-after", type=float, default=20)
    parser.add_argument("--run-after", type=float, default=60)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--json", default="bench-results/faults.json")
    args = parser.parse_args(argv)

    with open(args.config) as f:
        app = yaml.safe_load(f)["applications"][0]
    app_args = fault_app_args(app["args"], args.worker_replicas, args.ingress_replicas)
    model = app_args["models"][0]["id"]
    ray.init(include_dashboard=False, log_to_driver=False)
    reports = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(app_args), name="chatserve", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{args.port}"
        wait_ready(url)
        load = FaultLoad(url=url, model=model, concurrency=args.concurrency, max_tokens=args.max_tokens,
                         kill_after_s=args.kill_after, run_after_s=args.run_after)
        for fault, deployment in (("kill worker replica", worker_deployment_name(model)),
                                  ("kill ingress replica", INGRESS)):
            report = run_fault(fault, "chatserve", deployment, load)
            print(report.line(), flush=True)
            reports.append(report)
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "worker_replicas": args.worker_replicas,
                       "ingress_replicas": args.ingress_replicas,
                       "load": {"concurrency": args.concurrency, "max_tokens": args.max_tokens},
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "faults": [asdict(r) for r in reports]}, f, indent=2)


if __name__ == "__main__":
    main()
