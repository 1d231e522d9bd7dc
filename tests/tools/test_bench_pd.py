"""tools.bench.pd: the two setups it starts are valid app configs on the same cores, and
its inter-token gaps leave out each stream's first (the hand-over) and keep a window."""

from __future__ import annotations

from serve_app.config.app_config import parse_app_config
from tools.bench.compare import Model
from tools.bench.pd import app_args, gaps


def test_both_setups_are_valid_configs_sharing_the_threads(tmp_path):
    model = Model("m", str(tmp_path), tmp_path, 64)
    colocated = parse_app_config(app_args(model, "float32", 2, disaggregated=False)).models[0]
    split = parse_app_config(app_args(model, "float32", 2, disaggregated=True)).models[0]
    assert colocated.disaggregation is None and colocated.engine.torch_threads == 2
    assert split.disaggregation is not None and split.engine.torch_threads == 1
    assert split.worker_serve_options("prefill")["num_replicas"] == split.worker_serve_options("decode")[
        "num_replicas"] == 1


def test_gaps_leave_out_the_first_and_keep_the_window():
    streams = [[0.0, 1.0, 1.1, 1.3], [0.5, 2.0, 2.05]]
    assert [round(g) for g in gaps(streams)] == [100, 200, 50]
    assert [round(g) for g in gaps(streams, start=1.2, end=2.01)] == [200]
