"""`make serve`'s command: Serve's own `serve run`, every argument passed through, in a Ray
started for one machine: without the dashboard's modules unless `--dashboard` is given.

    python -m serve_app.launch [--dashboard] configs/default.yaml [serve run's options]

Why not plain `serve run`: it starts Ray with the dashboard, whose modules (nodes, jobs,
events, metrics, reports, Serve's REST API) poll the GCS and the node's agent every few
seconds, and the agent and GCS answer. On two cores every such wake-up preempts a model
thread, and its partner waits for it at the next barrier: idle, the whole stack took 9.4 %
of an AMX Xeon's 2 CPUs with the modules and 4.9 % without, and one stream decoded 4-18 %
(median 8 %) faster without them (docs/BENCHMARKS.md, "Ray without the dashboard"). What the modules
give is the web UI and the REST API that `serve status`, `serve config` and `ray job` read:
`--dashboard` (`make serve DASHBOARD=1`) starts them as `serve run` does. A Ray that is
already running (`--address`, RAY_ADDRESS) is joined as it was started: `include_dashboard`
only applies to a Ray that `ray.init` starts.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.serve.scripts import cli as serve_cli


def parse_args(argv: Sequence[str] | None) -> tuple[bool, list[str]]:
    """(whether to start the dashboard, the arguments for `serve run`)."""
    parser = argparse.ArgumentParser(
        prog="python -m serve_app.launch", add_help=False,
        description="`serve run` in a Ray started without the dashboard's modules (unless --dashboard)")
    parser.add_argument("--dashboard", action="store_true",
                        help="start Ray's dashboard too (its web UI; `serve status` reads its REST API)")
    known, serve_args = parser.parse_known_args(argv)
    return known.dashboard, serve_args


def init_choosing_dashboard(init: Callable[..., Any], dashboard: bool) -> Callable[..., Any]:
    """`init` (ray.init) with `include_dashboard` defaulting to `dashboard`."""

    @functools.wraps(init)
    def chosen(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("include_dashboard", dashboard)
        return init(*args, **kwargs)

    return chosen


def main(argv: Sequence[str] | None = None, serve: Callable[..., Any] = serve_cli.main) -> Any:
    """Run `serve run` with `argv` (less --dashboard). `serve run` calls ray.init with no
    dashboard choice of its own (it has no option for one), so the choice is made by
    giving ray.init its default for the length of the command."""
    dashboard, serve_args = parse_args(argv)
    start_ray = ray.init
    ray.init = init_choosing_dashboard(start_ray, dashboard)
    try:
        return serve(["run", *serve_args], prog_name="serve")
    finally:
        ray.init = start_ray


if __name__ == "__main__":
    main()
