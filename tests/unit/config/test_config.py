"""Model / application config validation (no Ray started)."""

from __future__ import annotations

import pydantic
import pytest
import yaml

from serve_app.config.app_config import ConfigError, parse_app_config
from tests.support.paths import REPO_ROOT
from workers.contract.model_config import ModelConfig

ROOT = REPO_ROOT


def good_args() -> dict:
    return {
        "models": [
            {
                "id": "tiny",
                "source": "/models/tiny",
                "device": "cpu",
                "dtype": "float32",
                "engine": {"block_size": 8, "max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 256},
                "deployment": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
            },
            {"id": "other"},
        ],
        "ingress": {"max_ongoing_requests": 10},
        "server": {"full_text_enabled": True},
    }


def test_good_config_parses():
    cfg = parse_app_config(good_args())
    tiny = cfg.model("tiny")
    assert tiny is not None
    assert tiny.engine.block_size == 8 and tiny.engine.max_num_seqs == 4
    assert tiny.engine.max_model_len == 256
    assert tiny.deployment.num_replicas == 2
    assert tiny.deployment.serve_options()["num_replicas"] == 2
    assert cfg.ingress.max_ongoing_requests == 10
    assert cfg.server.full_text_enabled is True
    other = cfg.model("other")
    assert other.source.startswith("builtin:") and other.device == "cpu"
    assert other.engine.block_size == 16  # defaults filled in
    assert cfg.model("missing") is None


def test_unknown_key_names_its_dotted_path():
    args = good_args()
    args["models"][0]["engine"]["max_num_seq"] = 8  # typo of max_num_seqs
    with pytest.raises(ConfigError) as info:
        parse_app_config(args)
    assert "models.0.engine.max_num_seq" in str(info.value)


def test_every_bad_key_is_reported():
    args = good_args()
    args["models"][1]["engin"] = {}
    args["server"]["colour"] = "blue"
    with pytest.raises(ConfigError) as info:
        parse_app_config(args)
    message = str(info.value)
    assert "models.1.engin" in message and "server.colour" in message


def test_bad_value_rejected():
    args = good_args()
    args["models"][0]["engine"]["block_size"] = 0
    with pytest.raises(ConfigError, match="models.0.engine.block_size"):
        parse_app_config(args)


def test_duplicate_model_ids_rejected():
    args = good_args()
    args["models"][1]["id"] = "tiny"
    with pytest.raises(ConfigError, match="unique"):
        parse_app_config(args)


def test_served_model_names_are_one_namespace_with_ids_unset_and_adapters():
    args = good_args()
    args["models"][0]["served_model_name"] = "alias"  # one name or a list
    config = parse_app_config(args)
    assert config.models[0].names == ["alias"] and config.served("alias") is config.models[0]
    assert config.served("tiny") is None  # the id is the config's name once served names are set
    assert config.served_names() == ["alias", *config.models[1].names]
    args["models"][0]["served_model_name"] = ["alias", config.models[1].id]
    with pytest.raises(ConfigError, match=rf"repeated: \['{config.models[1].id}'\]"):
        parse_app_config(args)
    for empty in ([], ["alias", ""]):
        args["models"][0]["served_model_name"] = empty
        with pytest.raises(ConfigError, match="models.0.served_model_name"):
            parse_app_config(args)


def test_no_models_rejected():
    with pytest.raises(ConfigError, match="models"):
        parse_app_config({"models": []})


def test_cuda_without_gpus_rejected():
    with pytest.raises(pydantic.ValidationError, match="num_gpus"):
        ModelConfig.model_validate({"id": "m", "device": "cuda"})
    args = good_args()
    args["models"][0]["device"] = "cuda"
    with pytest.raises(ConfigError, match="num_gpus"):
        parse_app_config(args)
    # With a GPU reserved it is fine.
    args["models"][0]["deployment"]["ray_actor_options"]["num_gpus"] = 1
    assert parse_app_config(args).model("tiny").device == "cuda"


def test_cpu_with_gpus_rejected():
    with pytest.raises(pydantic.ValidationError, match="wastes a GPU"):
        ModelConfig.model_validate({"id": "m", "deployment": {"ray_actor_options": {"num_gpus": 1}}})


def test_default_yaml_args_parse():
    config = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    app = config["applications"][0]
    assert app["import_path"] == "serve_app.app:build_app"
    cfg = parse_app_config(app["args"])
    assert len(cfg.models) >= 1
    model = cfg.models[0]
    assert model.device == "cpu"
    assert model.engine.block_size >= 1


def test_tool_and_reasoning_parsers_are_typed_per_model():
    args = good_args()
    args["models"][0].update(tool_call_parser="llama3_json", reasoning_parser="deepseek_r1")
    cfg = parse_app_config(args)
    assert (cfg.model("tiny").tool_call_parser, cfg.model("tiny").reasoning_parser) == ("llama3_json", "deepseek_r1")
    assert (cfg.model("other").tool_call_parser, cfg.model("other").reasoning_parser) == ("hermes", None)
    args["models"][1]["tool_call_parser"] = "granite"
    with pytest.raises(ConfigError, match="models.1.tool_call_parser"):
        parse_app_config(args)
