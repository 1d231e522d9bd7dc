"""Deterministic outputs through Serve across a worker kill: the default model on two worker
replicas with `engine.deterministic: true`, in each dtype asked. 16 streams (8 greedy, 8
seeded at temperature 0.9; tools/reliability/determinism.py's prompts) run each alone, one
after another; then among 48 other streams (64 at once); then each alone again, its prompt
now in a replica's prefix cache; then the 16 at once, undisturbed; then the same 16 again,
and once a third of their tokens arrived one worker replica is killed (`ray.kill`, no
restart): its streams resume on the other replica; last, the app is deployed again with
another chunked-prefill budget (`engine.max_num_batched_tokens` 48, 16 prompt tokens a step
beside running streams) and the 16 run at once there. The script counts the streams whose
text equals their run alone in each of those runs, and the resumes (/metrics
`chatserve_requests_resumed_total`). `--also-off`: each dtype with the mode off too.

    python -m tools.reliability.determinism_serve --dtype float32 bfloat16 [--also-off]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from tools.reliability.determinism import prompt_text, sampling
from tools.reliability.replicas import (
    kill_replica,
    wait_all_running,
    wait_replaced,
    with_worker_replicas,
)
from tools.reliability.soak import resumes_counted

APP = "determinism"
STREAMS = 16


OTHERS = 48  # the streams beside the 16 in the "among others" run
# The other chunked-prefill budget (determinism.py's, in the engine): the prompts (~30-40
# tokens) are then cut differently, their chunks sharing steps with other streams' rows.
OTHER_BUDGET = {"max_num_batched_tokens": 48, "max_prefill_tokens_while_decoding": 16}


def bodies(model: str, max_tokens: int, count: int = STREAMS, offset: int = 0) -> list[dict]:
    """determinism.py's requests `offset`.. as chat bodies: even ones greedy, odd ones seeded."""
    return [{"model": model, "messages": [{"role": "user", "content": prompt_text(k)}], "max_tokens": max_tokens,
             "ignore_eos": True, "stream": True, **sampling(k)} for k in range(offset, offset + count)]


def one_at_a_time(url: str, requests: list[dict]) -> list[str]:
    return [asyncio.run(run_streams(url, [body], None, None))[0] for body in requests]


def matches(reference: list[str], texts: list[str]) -> tuple[int, int]:
    """How many texts equal their reference, in all and among the greedy (even) ones."""
    return sum(a == b for a, b in zip(reference, texts)), sum(a == b for a, b in zip(reference[::2], texts[::2]))


def equal_to(reference: list[str], texts: list[str]) -> str:
    """'equal/16 (greedy equal/8)'."""
    equal, greedy = matches(reference, texts)
    return f"{equal}/{len(reference)} (greedy {greedy}/{len(reference[::2])})"


async def stream_text(client: httpx.AsyncClient, url: str, body: dict, progress: list[int]) -> str:
    """The stream's content; an error event or a cut stream is part of what is compared."""
    pieces = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "".join(pieces) + f" <error {event['error'].get('code')}>"
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    pieces.append(choice["delta"]["content"])
                    progress[0] += 1
    return "".join(pieces)


async def run_streams(url: str, requests: list[dict], kill_at: int | None, kill) -> list[str]:
    """Every stream's text; with `kill_at`, `kill` runs in a thread once that many chunks arrived."""
    progress = [0]

    async def killer() -> None:
        while progress[0] < kill_at:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(kill)

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream_text(client, url, body, progress)) for body in requests]
        watcher = asyncio.create_task(killer()) if kill_at is not None else None
        texts = await asyncio.gather(*tasks)
        if watcher is not None:
            await watcher
    return texts


def deployed(args: dict, url: str) -> str:
    """Deploys the app with `args` (2 worker replicas), once every replica runs: the worker deployment's name."""
    from ray import serve

    from serve_app.app import build_app, worker_deployment_name
    from tools.servers import wait_ready

    deployment = worker_deployment_name(args["models"][0]["id"])
    serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
    wait_ready(url)
    wait_all_running(APP, deployment, 2, timeout_s=300)
    return deployment


def with_engine(config: dict, dtype: str, deterministic: bool, **engine) -> dict:
    """`config`'s app args on 2 worker replicas, its model in `dtype` with these engine options."""
    args = with_worker_replicas(config, 2)
    model = args["models"][0]
    model["dtype"] = dtype
    model.setdefault("engine", {}).update(deterministic=deterministic, **engine)
    return args


def one_dtype(config: dict, dtype: str, deterministic: bool, url: str, max_tokens: int) -> dict:
    from ray import serve

    args = with_engine(config, dtype, deterministic)
    model = args["models"][0]
    try:
        deployment = deployed(args, url)
        requests = bodies(model["id"], max_tokens)
        alone = one_at_a_time(url, requests)
        among = asyncio.run(run_streams(url, requests + bodies(model["id"], max_tokens, OTHERS, STREAMS), None,
                                        None))[:STREAMS]
        after_hit = one_at_a_time(url, requests)
        undisturbed = asyncio.run(run_streams(url, requests, None, None))
        before = resumes_counted(url, model["id"]) or 0
        killed: list[str] = []

        def kill() -> None:
            killed.append(kill_replica(APP, deployment))

        started = time.monotonic()
        disturbed = asyncio.run(run_streams(url, requests, STREAMS * max_tokens // 3, kill))
        resumes = (resumes_counted(url, model["id"]) or 0) - before
        replaced = wait_replaced(APP, deployment, killed[0], 2, started, 300) if killed else None
        serve.delete(APP)
        deployed(with_engine(config, dtype, deterministic, **OTHER_BUDGET), url)
        other_budget = asyncio.run(run_streams(url, requests, None, None))
        equal, greedy = matches(undisturbed, disturbed)
        return {"dtype": dtype, "deterministic": deterministic,
                "vs alone": {"among 63 others": equal_to(alone, among), "after a cache hit": equal_to(alone, after_hit),
                             "16 at once": equal_to(alone, undisturbed), "16 with a kill": equal_to(alone, disturbed),
                             "budget 48": equal_to(alone, other_budget)},
                "equal": equal, "greedy_equal": greedy, "seeded_equal": equal - greedy,
                "streams": STREAMS, "resumes": resumes, "killed": killed, "replaced_s": replaced,
                "differing": [i for i, (a, b) in enumerate(zip(undisturbed, disturbed)) if a != b]}
    finally:
        serve.delete(APP)


def main(argv: list[str] | None = None) -> None:
    import ray
    import yaml
    from ray import serve

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--also-off", action="store_true", help="each dtype with the mode off too")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    with open(args.config) as f:
        config = yaml.safe_load(f)["applications"][0]["args"]
    ray.init(include_dashboard=False, log_to_driver=False)
    url = f"http://127.0.0.1:{args.port}"
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        for dtype in args.dtype:
            for deterministic in (True, False) if args.also_off else (True,):
                report = one_dtype(config, dtype, deterministic, url, args.max_tokens)
                print(json.dumps(report), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
