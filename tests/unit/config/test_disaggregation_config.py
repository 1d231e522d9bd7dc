"""The `disaggregation` config: each side's Serve options, and what it refuses, named by
its dotted path."""

from __future__ import annotations

import pytest

from serve_app.app import worker_deployment_name
from serve_app.config.app_config import ConfigError, parse_app_config
from workers.contract.model_config import ModelConfig

SIDES = {"prefill": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
         "decode": {"num_replicas": 3, "max_ongoing_requests": 64}}


def test_each_side_takes_its_own_serve_options():
    model = ModelConfig(id="m", source="/models/m", disaggregation=SIDES)
    prefill, decode = model.worker_serve_options("prefill"), model.worker_serve_options("decode")
    assert (prefill["num_replicas"], prefill["ray_actor_options"]) == (2, {"num_cpus": 1})
    assert (decode["num_replicas"], decode["max_ongoing_requests"]) == (3, 64)
    assert model.decode_deployment.num_replicas == 3
    assert ModelConfig.model_validate(model.model_dump()) == model  # the ingress re-reads the dumped config
    assert worker_deployment_name("m/x") == "ModelWorker-m-x"
    assert worker_deployment_name("m/x", "prefill") == "ModelWorker-m-x-prefill"


@pytest.mark.parametrize(("fields", "message"), [
    ({"deployment": {"num_replicas": 2}, "disaggregation": SIDES}, r"models\.0.*deployment: with disaggregation"),
    ({"disaggregation": SIDES, "parallel": {"tensor_parallel_size": 2}},
     r"models\.0.*disaggregation: a model split over shards \(parallel\.tensor_parallel_size\)"),
    ({"disaggregation": SIDES, "engine": {"enable_prefix_caching": False}},
     r"models\.0.*disaggregation: .*enable_prefix_caching: true"),
    ({"disaggregation": {"prefill": {"autoscaling_config": {"min_replicas": 0, "max_replicas": 2}}}},
     r"models\.0.*disaggregation\.prefill\.autoscaling_config\.min_replicas"),
    ({"device": "cuda", "disaggregation": {"prefill": {"ray_actor_options": {"num_gpus": 1}}}},
     r"models\.0.*disaggregation\.decode\.ray_actor_options\.num_gpus > 0"),
    ({"disaggregation": {"prefill": {"num_replicas": 0}}}, r"models\.0\.disaggregation\.prefill\.num_replicas"),
    ({"disaggregation": {"middle": {}}}, r"models\.0\.disaggregation\.middle"),
])
def test_what_disaggregation_cannot_do_is_a_config_error(fields, message):
    with pytest.raises(ConfigError, match=message):
        parse_app_config({"models": [{"id": "m", "source": "/models/m", **fields}]})
