"""Every shipped `serve run` config (configs/*.yaml) is valid; no Ray is started."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from serve_app.config.app_config import ConfigError, parse_app_config
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / name).read_text())


def test_the_expected_configs_exist():
    names = {path.name for path in CONFIGS}
    assert {"default.yaml", "gpu.yaml", "multi-model.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_a_valid_chatserve_serve_config(path: Path):
    config = yaml.safe_load(path.read_text())
    apps = config["applications"]
    assert len(apps) == 1
    app = apps[0]
    assert app["import_path"] == "serve_app.app:build_app"
    assert app["route_prefix"] == "/"
    parsed = parse_app_config(app["args"])  # strict: unknown keys and bad values raise
    assert parsed.models


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's own pydantic v1-style fields
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_a_valid_serve_deploy_config(path: Path):
    """Ray Serve's own schema for `serve run` / `serve deploy` / KubeRay's serveConfigV2
    (pydantic only: importing it starts no Ray)."""
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))


def test_gpu_config_puts_the_model_on_one_gpu_and_autoscales():
    app = parse_app_config(load("gpu.yaml")["applications"][0]["args"])
    (model,) = app.models
    assert model.device == "cuda" and model.dtype == "bfloat16"
    assert model.deployment.ray_actor_options["num_gpus"] == 1
    scaling = model.deployment.autoscaling_config
    assert scaling is not None
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 4)
    # A replica is "busy" below a full batch, else the autoscaler never adds one.
    assert 0 < scaling.target_ongoing_requests <= model.engine.max_num_seqs
    assert model.deployment.max_ongoing_requests > scaling.target_ongoing_requests
    options = model.deployment.serve_options()
    assert "autoscaling_config" in options and "num_replicas" not in options


def test_multi_model_config_serves_two_distinct_ids():
    app = parse_app_config(load("multi-model.yaml")["applications"][0]["args"])
    ids = [m.id for m in app.models]
    assert len(ids) == 2 and len(set(ids)) == 2
    first, second = app.models
    assert first.engine != second.engine  # the second id is a differently limited engine


def test_disaggregated_config_fits_two_cores():
    app = parse_app_config(load("disaggregated.yaml")["applications"][0]["args"])
    (model,) = app.models
    sides = model.disaggregation
    assert sides is not None and model.engine.torch_threads == 1 and model.engine.enable_prefix_caching
    reserved = sides.prefill.ray_actor_options["num_cpus"] + sides.decode.ray_actor_options["num_cpus"]
    assert reserved + app.ingress.ray_actor_options["num_cpus"] <= 2  # fits a 2-core machine
    assert sides.prefill_nice > 0


def test_a_misspelt_key_in_default_yaml_names_its_dotted_path():
    args = copy.deepcopy(load("default.yaml")["applications"][0]["args"])
    args["models"][0]["deployment"]["autoscaling_config"] = {"max_replica": 2}  # typo
    with pytest.raises(ConfigError) as info:
        parse_app_config(args)
    assert "models.0.deployment.autoscaling_config.max_replica" in str(info.value)
