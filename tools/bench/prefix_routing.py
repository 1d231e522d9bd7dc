"""Conversation benchmark of the worker router, one command: 2 worker replicas, prefix-aware
routing against Serve's power of two choices, on the same load in one run.

    python -m tools.bench.prefix_routing --model default --conversations 32 --turns 4

The load: --conversations conversations at once, each --turns turns long, all sharing one
system prompt of about --system-tokens tokens; each turn sends the whole conversation so far
(with the model's answers) and --max-tokens output tokens, after a pause of 0 to 2x
--think-s seconds (a person reading and typing: without it, each turn goes out the moment
its last one freed a slot on its replica, and Serve's power of two choices, seeing that
replica less loaded, sends it back there by chance of timing). Reported per router: the cached
share of prompt tokens in turns 2 and later (usage.prompt_tokens_details.cached_tokens),
output tok/s over the whole load, and the requests each replica ran. Then a load with no
shared prefixes (--unshared requests, 16 at a time): the largest share one replica took.

Ray and Serve start in this process (SERVE_ENV of tools/bench/compare.py, Serve's proxy on
loopback) and are shut down after each router; loopback only, bounded request counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from tools.bench.compare import REPO, SERVE_ENV, resolve_model

PORT = 8000
WORDS = ("river cloud stone forecast pressure front humid breeze storm valley coast season sunrise "
         "drizzle frost gust monsoon radar satellite thunder visibility warm cold dry wet north south").split()


@dataclass
class RouterReport:
    router: str
    turns: int = 0
    failed: int = 0
    wall_s: float = 0.0
    output_tok_s: float = 0.0
    later_turn_prompt_tokens: int = 0
    later_turn_cached_tokens: int = 0
    first_turn_cached_share: float = 0.0
    later_turn_cached_share: float = 0.0
    cached_share_by_turn: list[float] = field(default_factory=list)
    conversation_requests_per_replica: list[int] = field(default_factory=list)
    unshared_requests_per_replica: list[int] = field(default_factory=list)
    unshared_max_share: float = 0.0


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def app_args(model, dtype: str, prefix_aware: bool) -> dict:
    """configs/default.yaml's app with 2 worker replicas of `model`, one core each."""
    config = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    args = config["applications"][0]["args"]
    spec = args["models"][0]
    spec.update(id=model.name, source=model.source, dtype=dtype, routing={"prefix_aware": prefix_aware})
    spec["engine"]["torch_threads"] = 1
    spec["deployment"].update(num_replicas=2, ray_actor_options={"num_cpus": 0})
    args["ingress"]["ray_actor_options"] = {"num_cpus": 0}
    return args


async def conversation(client: httpx.AsyncClient, model: str, system: str, opening: str, turns: int,
                       max_tokens: int, think_s: float, rng: random.Random) -> list[dict]:
    """One conversation's turns; each item is that turn's usage (or an error)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": opening}]
    usages = []
    for turn in range(turns):
        if turn:
            await asyncio.sleep(rng.uniform(0, 2 * think_s))
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            usages.append({"error": response.text[:200]})
            return usages
        answer = response.json()
        usages.append(answer["usage"])
        messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Thanks. Question {turn + 2}: what about the {WORDS[turn]}?"}]
    return usages


async def unshared_load(client: httpx.AsyncClient, model: str, requests: int, max_tokens: int) -> int:
    rng, gate, failed = random.Random(7), asyncio.Semaphore(16), 0

    async def one(n: int) -> None:
        nonlocal failed
        async with gate:
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"{n}: {words(rng, 40)}"}]}
            failed += (await client.post("/v1/chat/completions", json=body)).status_code != 200
    await asyncio.gather(*(one(n) for n in range(requests)))
    return failed


async def requests_per_replica(model_name: str) -> dict[str, int]:
    from ray import serve

    from serve_app.app import worker_deployment_name
    from serve_app.transport.replica_directory import ReplicaDirectory, deployment_key

    handle = serve.get_deployment_handle(worker_deployment_name(model_name), app_name="bench")
    await handle.stats.remote()  # builds this process's router, which names the replicas
    replicas = ReplicaDirectory._replicas[deployment_key("bench", worker_deployment_name(model_name))]
    stats = {r: await handle.stats.remote(replica=r) for r in sorted(replicas)}
    return {r: s.requests_by_channel + s.requests_by_call for r, s in stats.items()}


def run_router(args, model, prefix_aware: bool) -> RouterReport:
    import ray
    from ray import serve

    from serve_app.app import build_app

    report = RouterReport("prefix-aware" if prefix_aware else "power of two choices")
    rng = random.Random(11)
    system = "You are a weather assistant. Facts you know: " + words(rng, int(args.system_tokens * 0.9))
    openings = [f"I live in town {n}. My notes: {words(rng, 60)}. Will it rain today?" for n in range(args.conversations)]
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        serve.run(build_app(app_args(model, args.dtype, prefix_aware)), name="bench", route_prefix="/")
        report = asyncio.run(_measure(args, model, report, system, openings))
    finally:
        serve.shutdown()
        ray.shutdown()
    return report


async def _measure(args, model, report: RouterReport, system: str, openings: list[str]) -> RouterReport:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=600) as client:
        await client.post("/v1/chat/completions", json={"model": model.name, "max_tokens": 2, "messages": [
            {"role": "user", "content": "warm up"}]})
        before = await requests_per_replica(model.name)
        start = time.perf_counter()
        conversations = await asyncio.gather(*(
            conversation(client, model.name, system, opening, args.turns, args.max_tokens, args.think_s,
                         random.Random(n)) for n, opening in enumerate(openings)))
        report.wall_s = time.perf_counter() - start
        middle = await requests_per_replica(model.name)
        report.failed = await unshared_load(client, model.name, args.unshared, args.max_tokens)
        after = await requests_per_replica(model.name)
    usages = [u for turns in conversations for u in turns]
    report.failed += sum("error" in u for u in usages)
    ok = [(turn, u) for turns in conversations for turn, u in enumerate(turns) if "error" not in u]
    report.turns = len(ok)
    report.output_tok_s = sum(u["completion_tokens"] for _, u in ok) / report.wall_s
    first = [u for turn, u in ok if turn == 0]
    later = [u for turn, u in ok if turn > 0]
    report.first_turn_cached_share = sum(cached(u) for u in first) / max(1, sum(u["prompt_tokens"] for u in first))
    report.later_turn_prompt_tokens = sum(u["prompt_tokens"] for u in later)
    report.later_turn_cached_tokens = sum(cached(u) for u in later)
    report.later_turn_cached_share = report.later_turn_cached_tokens / max(1, report.later_turn_prompt_tokens)
    for turn in range(args.turns):
        usages_of_turn = [u for t, u in ok if t == turn]
        report.cached_share_by_turn.append(
            sum(cached(u) for u in usages_of_turn) / max(1, sum(u["prompt_tokens"] for u in usages_of_turn)))
    report.conversation_requests_per_replica = [middle[r] - before.get(r, 0) for r in middle]
    report.unshared_requests_per_replica = [after[r] - middle.get(r, 0) for r in after]
    report.unshared_max_share = max(report.unshared_requests_per_replica) / max(1, args.unshared)
    return report


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def table(reports: list[RouterReport]) -> str:
    lines = ["| router | turns (failed) | cached share, turn 1 / turns 2+ | output tok/s | requests per replica "
             "| no shared prefix: requests per replica (max share) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in reports:
        lines.append(f"| {r.router} | {r.turns} ({r.failed}) | {r.first_turn_cached_share:.0%} / "
                     f"{r.later_turn_cached_share:.1%} | {r.output_tok_s:.1f} | {r.conversation_requests_per_replica} "
                     f"| {r.unshared_requests_per_replica} ({r.unshared_max_share:.0%}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default (SmolLM2-135M-Instruct) or near-free")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=500, help="about this many tokens of system prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--think-s", type=float, default=2.0, help="mean pause between a conversation's turns")
    parser.add_argument("--unshared", type=int, default=64, help="requests of the load with no shared prefix")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = parser.parse_args(argv)
    os.environ.update(SERVE_ENV)  # before Ray starts: its processes inherit them
    args.out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model, args.out)
    reports = [run_router(args, model, prefix_aware) for prefix_aware in (True, False)]
    (args.out / "prefix-routing.json").write_text(json.dumps([asdict(r) for r in reports], indent=2))
    print(f"\n{os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M')}, {model.name}, {args.conversations} "
          f"conversations x {args.turns} turns, 2 worker replicas\n{table(reports)}")


if __name__ == "__main__":
    main()
