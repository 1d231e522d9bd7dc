"""The long fuzz run (`make fuzz`): thousands of generated request bodies against a
chatserve app it starts on loopback, then the figures of docs/RELIABILITY.md.

    python -m tools.reliability.fuzz --requests 3000 --json fuzz-results/fuzz.json
    python -m tools.reliability.fuzz --config configs/default.yaml   # the real default model

Bodies: tools/reliability/fuzz_bodies.py; checks: tools/reliability/fuzz_harness.py. Exits 1 when any answer
was a problem (5xx, malformed), a replica restarted, or the engine kept sequences or
KV blocks afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

APP_NAME = "fuzz"


def main() -> int:
    args = parse_args()
    import ray
    from ray import serve

    from serve_app.app import build_app
    from tests.support.serve_fixtures import free_port, wait_ready, worker_stats
    from tools.reliability.fuzz_bodies import generate_cases
    from tools.reliability.fuzz_harness import replica_actor_names, run_cases, wait_idle

    app_args, model_id = app_config(args.config)
    cases = generate_cases(args.requests, args.seed, model_id)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, timeout=600)
        stats = lambda: worker_stats(APP_NAME, model_id)  # noqa: E731
        before, replicas = wait_idle(stats), replica_actor_names(APP_NAME)
        report = run_cases(url, cases, args.concurrency)
        after, replicas_after = wait_idle(stats), replica_actor_names(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    figures = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": model_id, "seed": args.seed, "concurrency": args.concurrency,
        "requests_tried": len(report.outcomes),
        "status_histogram": {str(k): v for k, v in sorted(report.statuses.items())},
        "server_errors_5xx": report.server_errors,
        "problems": len(report.problems),
        "replicas_restarted": len(replicas - replicas_after),
        "worker_pid_changed": after.pid != before.pid,
        "worker_rss_mib_before_after": [round(before.rss_bytes / 2**20), round(after.rss_bytes / 2**20)],
        "leaked_sequences": after.active_requests + after.running + after.waiting,
        "kv_blocks_used_before_after": [before.kv_blocks_used, after.kv_blocks_used],
        "wall_s": round(report.seconds, 1),
        "by_kind": {kind: dict(sorted(c.items())) for kind, c in report.by_kind().items()},
    }
    print(json.dumps(figures, indent=1))
    if report.problems:
        print(f"\n{len(report.problems)} problems (first 30):\n{report.describe_problems(30)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**figures, "problem_samples": report.describe_problems(100)}, indent=1))
    clean = not (report.problems or figures["replicas_restarted"] or figures["worker_pid_changed"]
                 or figures["leaked_sequences"]
                 or after.kv_blocks_used != before.kv_blocks_used)
    return 0 if clean else 1


def app_config(config: str | None) -> tuple[dict, str]:
    """The app's args and its (first) model id: from a serve config file, or the tiny model."""
    if config:
        app_args = yaml.safe_load(Path(config).read_text())["applications"][0]["args"]
        return app_args, app_args["models"][0]["id"]
    from tests.support.serve_fixtures import TINY_MODEL_ID, tiny_app_args
    from tests.support.tiny_models import write_tiny_model_dir

    model_dir = write_tiny_model_dir(Path(tempfile.mkdtemp(prefix="chatserve-fuzz-")))
    return tiny_app_args(model_dir), TINY_MODEL_ID


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=int(os.environ.get("FUZZ_SEED", "1")))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--config", help="a serve config (e.g. configs/default.yaml); default: the tiny test model")
    parser.add_argument("--json", help="also write the figures to this file")
    return parser.parse_args()


if __name__ == "__main__":
    start = time.monotonic()
    code = main()
    print(f"total {time.monotonic() - start:.0f} s (generation, start-up and the run)", file=sys.stderr)
    sys.exit(code)
