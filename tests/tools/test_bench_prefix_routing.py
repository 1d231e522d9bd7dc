"""The conversation benchmark's app config is a valid chatserve config with 2 worker
replicas and the router choice it names; its table reads its reports."""

from pathlib import Path

import pytest

from serve_app.config.app_config import parse_app_config
from tools.bench.compare import Model
from tools.bench.prefix_routing import RouterReport, app_args, table


@pytest.mark.parametrize("prefix_aware", [True, False])
def test_app_args_are_a_valid_two_replica_config(prefix_aware):
    model = Model("m", "builtin:smollm2-135m-instruct", Path("/nonexistent"), 64)
    config = parse_app_config(app_args(model, "float32", prefix_aware))
    spec = config.models[0]
    assert spec.deployment.num_replicas == 2 and spec.routing.prefix_aware is prefix_aware
    assert spec.engine.torch_threads == 1


def test_table_has_a_row_per_router():
    reports = [RouterReport("prefix-aware", turns=128, later_turn_cached_share=0.93,
                            conversation_requests_per_replica=[70, 58], unshared_requests_per_replica=[30, 34],
                            unshared_max_share=34 / 64),
               RouterReport("power of two choices", turns=128)]
    lines = table(reports).splitlines()
    assert len(lines) == 4 and "93.0%" in lines[2] and "(53%)" in lines[2]
