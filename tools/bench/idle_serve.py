"""What an idle Ray Serve stack costs the engine beside it: the engine's decode step timed
alone and beside `serve run` with no request in flight, alternating, in this process.

    python -m tools.bench.idle_serve --batch 1 64 --rounds 3
    python -m tools.bench.idle_serve --variant plain RAY_task_events_report_interval_ms=1000 \
        RAY_event_stats=1 RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.1    # Ray's defaults, beside make serve's

Ray's daemons and Serve's actors run periodic work even with no request. On a machine whose
cores all run the model's threads, each wake-up preempts one of them, and torch's threads wait
for each other at the end of every operator. The slowdown measured here is a floor under what
the Serve path loses to the engine offline (`make bench-cpu`) before a token is moved. The
server is the one `make bench-cpu` starts (`tools.bench.compare`: the default model's config,
`make serve`'s environment), plus each variant's environment.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tools.bench.compare import (
    DEFAULT_EDGE,
    EDGES,
    REPO,
    resolve_model,
    serve_config,
    serve_running,
)
from tools.bench.engine import PROMPT, engine_decode_ms
from workers.model.attention import register_paged_attention
from workers.model.loader import load_model
from workers.serving.host_memory import keep_freed_memory

ALONE = "alone"


def parse_variants(pairs: list[list[str]]) -> dict[str, dict[str, str]]:
    """`--variant NAME KEY=VALUE ...` pairs as {name: env}; `serve` (no extra environment) is
    always first."""
    variants: dict[str, dict[str, str]] = {"serve": {}}
    for name, *assignments in pairs:
        if name in variants or name == ALONE:
            raise SystemExit(f"variant name {name!r} is taken")
        bad = [item for item in assignments if "=" not in item]
        if bad:
            raise SystemExit(f"variant {name!r}: expected KEY=VALUE, got {bad}")
        variants[name] = dict(item.split("=", 1) for item in assignments)
    return variants


def slowdown_line(batch: int, runs: dict[str, list[float]]) -> str:
    """Each condition's median ms per step, and how much slower than alone it is."""
    alone = statistics.median(runs[ALONE])
    cells = [f"{ALONE} {alone:6.1f} ms"]
    for name, times in runs.items():
        if name != ALONE:
            median = statistics.median(times)
            cells.append(f"{name} {median:6.1f} ms ({median / alone - 1:+.1%})")
    return f"batch={batch:<3} " + "   ".join(cells)


def round_line(batch: int, runs: dict[str, list[float]]) -> str:
    """The latest round's ms per step under each condition."""
    return f"batch={batch:<3} " + "   ".join(f"{name} {times[-1]:6.1f}" for name, times in runs.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=20, help="decode steps a timing")
    parser.add_argument("--repeat", type=int, default=5, help="timings a condition a round (their median counts)")
    parser.add_argument("--rounds", type=int, default=3, help="alone, then each server, this many times")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds a server idles before the timing")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME [KEY=VALUE ...]",
                        help="a server with more environment, beside the plain one")
    parser.add_argument("--edge", choices=sorted(EDGES), default=DEFAULT_EDGE)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = parser.parse_args(argv)
    variants = parse_variants(args.variant)
    args.out.mkdir(parents=True, exist_ok=True)
    model = resolve_model("default", args.out)
    config = serve_config(model, "float32", args.out)
    keep_freed_memory()  # as the CPU worker does
    loaded = load_model(model.source, dtype="float32")
    loaded.model.set_attn_implementation(register_paged_attention())
    prompt_ids = loaded.tokenizer(PROMPT)["input_ids"]

    def timing(batch: int) -> float:
        return statistics.median(engine_decode_ms(loaded.model, prompt_ids, batch, args.steps)[0]
                                 for _ in range(args.repeat))

    runs = {batch: {name: [] for name in (ALONE, *variants)} for batch in args.batch}
    for round_ in range(1, args.rounds + 1):
        for batch in args.batch:
            runs[batch][ALONE].append(timing(batch))
        for name, env in variants.items():
            with serve_running(config, args.edge, env, args.out / f"idle-serve-{name}.log"):
                time.sleep(args.settle)
                for batch in args.batch:
                    runs[batch][name].append(timing(batch))
        for batch in args.batch:
            print(f"{time.strftime('%H:%M:%S')} round {round_}: {round_line(batch, runs[batch])}", flush=True)
    for batch in args.batch:
        print(slowdown_line(batch, runs[batch]), flush=True)


if __name__ == "__main__":
    main()
