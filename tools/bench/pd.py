"""Prefill/decode disaggregation against one colocated replica, on the same cores and the
same load (`make bench-pd`).

    python -m tools.bench.pd --model default --streams 16 --long-prompt 2000 --long-requests 4

The load, per setup: --streams streaming requests (short prompts, --stream-tokens output
tokens, EOS ignored) run twice: alone, then while --long-requests prompts of about
--long-prompt tokens arrive one every --long-every-s seconds. Reported: the running
streams' inter-token gap p50/p99 alone and while the long prompts are prefilled (from the
first one's arrival to the last one's first token; a stream's first gap, the hand-over
pause under PD, is left out and reported on its own), the long prompts' TTFT, the KV
transfer per prompt token handed over (bytes and ms, from the decode worker's counters),
and output tok/s over the second run.

The setups share the machine's cores: colocated, one worker replica with --threads torch
threads; disaggregated, a prefill and a decode replica with half as many each. Ray and
Serve start in this process (SERVE_ENV of tools/bench/compare.py) and are shut down after
each setup; loopback only, bounded request counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from tools.bench.compare import REPO, SERVE_ENV, resolve_model
from tools.bench.engine import percentile

PORT = 8000
APP = "bench"
WORDS = ("river cloud stone forecast pressure front humid breeze storm valley coast season sunrise drizzle frost "
         "gust monsoon radar satellite thunder visibility warm cold dry wet north south").split()


@dataclass
class SetupReport:
    setup: str
    gap_p50_alone_ms: float = 0.0
    gap_p99_alone_ms: float = 0.0
    gap_p50_during_ms: float = 0.0
    gap_p99_during_ms: float = 0.0
    first_gap_ms: float = 0.0  # median gap between a stream's first and second token (the hand-over under PD)
    long_ttft_ms: list[float] = field(default_factory=list)
    output_tok_s: float = 0.0
    failed: int = 0
    handoffs: int = 0
    transfer_tokens: int = 0
    transfer_bytes_per_token: float = 0.0
    transfer_ms_per_1k_tokens: float = 0.0
    long_prompt_tokens: int = 0

    @property
    def p99_ratio(self) -> float:
        return self.gap_p99_during_ms / self.gap_p99_alone_ms if self.gap_p99_alone_ms else float("nan")


def app_args(model, dtype: str, threads: int, disaggregated: bool, prefill_nice: int | None = None) -> dict:
    """configs/default.yaml's app on `model`: one worker replica with `threads` torch threads,
    or a prefill and a decode replica with half as many each."""
    config = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    args = config["applications"][0]["args"]
    spec = args["models"][0]
    spec.update(id=model.name, source=model.source, dtype=dtype)
    deployment = dict(spec.pop("deployment"), ray_actor_options={"num_cpus": 0})
    spec["engine"]["torch_threads"] = max(1, threads // 2) if disaggregated else threads
    if disaggregated:
        spec["disaggregation"] = {"prefill": dict(deployment), "decode": dict(deployment)}
        if prefill_nice is not None:
            spec["disaggregation"]["prefill_nice"] = prefill_nice
    else:
        spec["deployment"] = deployment
    args["ingress"]["ray_actor_options"] = {"num_cpus": 0}
    return args


async def stream(client: httpx.AsyncClient, body: dict) -> tuple[float, list[float]]:
    """(send time, arrival time of each content delta) of one streamed request."""
    sent, arrivals = time.perf_counter(), []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}")
        async for line in response.aiter_lines():
            compact = line.replace('": "', '":"')
            if line.startswith("data: {") and '"content":"' in compact and '"content":""' not in compact:
                arrivals.append(time.perf_counter())
    return sent, arrivals


def gaps(arrivals: list[list[float]], start: float = 0.0, end: float = float("inf")) -> list[float]:
    """Inter-token gaps (ms) whose later token arrived in [start, end], each stream's first
    gap (a hand-over's pause) left out."""
    return [(b - a) * 1000 for times in arrivals for a, b in zip(times[1:], times[2:]) if start <= b <= end]


async def measure(args, model, report: SetupReport) -> SetupReport:
    rng = random.Random(5)
    streams = [{"model": model.name, "max_tokens": args.stream_tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Story {n}: {' '.join(rng.choices(WORDS, k=12))}"}]}
               for n in range(args.streams)]
    longs = [{"model": model.name, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
              "messages": [{"role": "user", "content": f"{n}: " + " ".join(rng.choices(WORDS, k=args.long_prompt))}]}
             for n in range(args.long_requests)]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=900) as client:
        await client.post("/v1/chat/completions", json={**streams[0], "max_tokens": 4, "stream": False})
        alone = await asyncio.gather(*(stream(client, body) for body in streams), return_exceptions=True)
        ok = [a for _, a in (r for r in alone if not isinstance(r, BaseException))]
        report.gap_p50_alone_ms, report.gap_p99_alone_ms = percentile(gaps(ok), 50), percentile(gaps(ok), 99)
        report.first_gap_ms = percentile([(a[1] - a[0]) * 1000 for a in ok if len(a) > 1], 50)
        report.failed += sum(isinstance(r, BaseException) for r in alone)
        before = await transfer_counters(model.name)
        start = time.perf_counter()
        running = [asyncio.create_task(stream(client, body)) for body in streams]

        async def long_prompt(k: int, body: dict):
            await asyncio.sleep(args.long_delay_s + k * args.long_every_s)
            return await stream(client, body)

        long_results = await asyncio.gather(*(long_prompt(k, b) for k, b in enumerate(longs)), return_exceptions=True)
        results = await asyncio.gather(*running, return_exceptions=True)
        wall = time.perf_counter() - start
        after = await transfer_counters(model.name)
        usage = await client.post("/v1/chat/completions", json={**longs[0], "max_tokens": 1, "stream": False})
        report.long_prompt_tokens = usage.json()["usage"]["prompt_tokens"]
    ok_long = [r for r in long_results if not isinstance(r, BaseException) and r[1]]
    ok = [a for _, a in (r for r in results if not isinstance(r, BaseException))]
    report.failed += len(results) - len(ok) + len(long_results) - len(ok_long)
    report.long_ttft_ms = [round((arrivals[0] - sent) * 1000, 1) for sent, arrivals in ok_long]
    if ok_long:
        window = gaps(ok, min(sent for sent, _ in ok_long), max(arrivals[0] for _, arrivals in ok_long))
        report.gap_p50_during_ms, report.gap_p99_during_ms = percentile(window, 50), percentile(window, 99)
    report.output_tok_s = (sum(map(len, ok)) + sum(len(a) for _, a in ok_long)) / wall
    report.handoffs = after["received"] - before["received"]
    report.transfer_tokens = after["tokens"] - before["tokens"]
    if report.transfer_tokens:
        report.transfer_bytes_per_token = (after["bytes"] - before["bytes"]) / report.transfer_tokens
        report.transfer_ms_per_1k_tokens = (after["ms"] - before["ms"]) / report.transfer_tokens * 1000
    return report


async def transfer_counters(model_name: str) -> dict[str, float]:
    from ray import serve

    from serve_app.app import worker_deployment_name

    stats = await serve.get_deployment_handle(worker_deployment_name(model_name), app_name=APP).stats.remote()
    return {"received": stats.kv_handoffs_received, "tokens": stats.kv_transfer_tokens, "bytes": stats.kv_transfer_bytes,
            "ms": stats.kv_transfer_ms}


def run_setup(args, model, disaggregated: bool) -> SetupReport:
    import ray
    from ray import serve

    from serve_app.app import build_app

    nice = f", prefill_nice {args.prefill_nice}" if args.prefill_nice is not None else ""
    report = SetupReport(f"disaggregated (1 prefill + 1 decode replica{nice})" if disaggregated
                         else "colocated (1 replica)")
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        serve.run(build_app(app_args(model, args.dtype, args.threads, disaggregated, args.prefill_nice)), name=APP,
                  route_prefix="/")
        report = asyncio.run(measure(args, model, report))
    finally:
        serve.shutdown()
        ray.shutdown()
    return report


def table(reports: list[SetupReport]) -> str:
    lines = ["| setup | gap p50 / p99 alone (ms) | gap p50 / p99 during long prefills (ms) | p99 ratio "
             "| first gap (ms) | long TTFT (ms) | KV handed over | output tok/s | failed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in reports:
        kv = (f"{r.handoffs} requests, {r.transfer_tokens} tokens: {r.transfer_bytes_per_token / 1e3:.1f} kB and "
              f"{r.transfer_ms_per_1k_tokens:.0f} ms per 1k tokens" if r.handoffs else "-")
        lines.append(f"| {r.setup} | {r.gap_p50_alone_ms:.0f} / {r.gap_p99_alone_ms:.0f} | {r.gap_p50_during_ms:.0f} / "
                     f"{r.gap_p99_during_ms:.0f} | {r.p99_ratio:.2f} | {r.first_gap_ms:.0f} | "
                     f"{statistics.median(r.long_ttft_ms or [0]):.0f} (median of {len(r.long_ttft_ms)}) | {kv} | "
                     f"{r.output_tok_s:.1f} | {r.failed} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default (SmolLM2-135M-Instruct) or near-free")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (halved per side with PD)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=160)
    parser.add_argument("--long-prompt", type=int, default=2000, help="about this many words of long prompt")
    parser.add_argument("--long-requests", type=int, default=4)
    parser.add_argument("--long-delay-s", type=float, default=2.0, help="first long prompt after the streams start")
    parser.add_argument("--long-every-s", type=float, default=3.0)
    parser.add_argument("--setups", nargs="+", default=["colocated", "disaggregated"])
    parser.add_argument("--prefill-nice", type=int, default=None, help="disaggregation.prefill_nice (default: "
                        "the config's default)")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = parser.parse_args(argv)
    os.environ.update(SERVE_ENV)  # before Ray starts: its processes inherit them
    args.out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model, args.out)
    reports = [run_setup(args, model, setup == "disaggregated") for setup in args.setups]
    (args.out / "pd.json").write_text(json.dumps([asdict(r) for r in reports], indent=2))
    print(f"\n{os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M')}, {model.name}, {args.dtype}, "
          f"{args.streams} streams x {args.stream_tokens} tokens, {args.long_requests} long prompts of "
          f"{reports[-1].long_prompt_tokens} tokens, {args.threads} torch threads in all\n{table(reports)}")


if __name__ == "__main__":
    main()
