"""A model's autoscaling config, request count or engine load, and what Serve is given (no Ray started)."""

from __future__ import annotations

import pytest
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

from serve_app.config.app_config import ConfigError, parse_app_config
from workers.contract.model_config import ENGINE_LOAD_POLICY, ModelConfig
from workers.serving.engine_load_policy import EngineLoadPolicy


def with_autoscaling(autoscaling: dict, ingress: dict | None = None) -> dict:
    args = {"models": [{"id": "m", "deployment": {"autoscaling_config": autoscaling}}]}
    if ingress is not None:
        args["ingress"] = {"autoscaling_config": ingress}
    return args


def serve_autoscaling(autoscaling: dict) -> dict:
    return parse_app_config(with_autoscaling(autoscaling)).models[0].deployment.serve_options()["autoscaling_config"]


def test_request_count_config_goes_to_serve_as_before():
    options = serve_autoscaling({"max_replicas": 3, "target_ongoing_requests": 8})
    assert "policy" not in options and "engine_load" not in options
    assert (options["max_replicas"], options["target_ongoing_requests"]) == (3, 8)
    assert ServeAutoscalingConfig(**options).policy.is_default_policy_function()


def test_engine_load_config_becomes_serves_custom_policy_with_its_targets():
    options = serve_autoscaling({"max_replicas": 3, "upscale_delay_s": 2,
                                 "engine_load": {"kv_cache_usage": 0.7, "queued_prompt_tokens_per_replica": 4096}})
    assert "engine_load" not in options and options["upscale_delay_s"] == 2
    serve_config = ServeAutoscalingConfig(**options)  # what Serve validates when the app deploys
    assert serve_config.policy.policy_function == ENGINE_LOAD_POLICY
    assert serve_config.policy.get_policy() is EngineLoadPolicy
    policy = EngineLoadPolicy(**serve_config.policy.policy_kwargs)
    assert (policy.targets.waiting_per_replica, policy.targets.kv_cache_usage) == (2, 0.7)  # the default, the set one
    assert (policy.targets.queued_prompt_tokens_per_replica, policy.downscale_margin) == (4096, 0.2)


def test_the_worker_revalidates_its_dumped_config():
    config = parse_app_config(with_autoscaling({"engine_load": {"waiting_per_replica": 1}})).models[0]
    assert ModelConfig.model_validate(config.model_dump()) == config


@pytest.mark.parametrize("engine_load, path", [
    ({"waiting_per_replica": None, "kv_cache_usage": None}, "models.0.deployment.autoscaling_config.engine_load"),
    ({"kv_cache_usage": 1.5}, "models.0.deployment.autoscaling_config.engine_load.kv_cache_usage"),
    ({"downscale_margin": 1}, "models.0.deployment.autoscaling_config.engine_load.downscale_margin"),
    ({"waiting_per_replica": 0}, "models.0.deployment.autoscaling_config.engine_load.waiting_per_replica"),
    ({"kv_usage": 0.5}, "models.0.deployment.autoscaling_config.engine_load.kv_usage"),
])
def test_bad_engine_load_names_its_dotted_path(engine_load, path):
    with pytest.raises(ConfigError, match=path.replace(".", r"\.") + ":"):
        parse_app_config(with_autoscaling({"max_replicas": 2, "engine_load": engine_load}))


def test_no_target_at_all_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="set at least one of"):
        parse_app_config(with_autoscaling({"engine_load": {"waiting_per_replica": None, "kv_cache_usage": None}}))


def test_the_ingress_has_no_engine_to_scale_on():
    with pytest.raises(ConfigError, match=r"ingress\.autoscaling_config\.engine_load"):
        parse_app_config(with_autoscaling({}, ingress={"engine_load": {}}))
