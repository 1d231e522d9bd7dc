"""The `parallel` block of a model (workers/contract/model_config.py): what a split replica
asks Serve for (one placement-group bundle per shard), what cannot be split, and a
tensor group no node or cluster can hold (serve_app/config/placement.py), each named by
its dotted path."""

from __future__ import annotations

import json

import pytest

from serve_app.app import check_placement
from serve_app.config.app_config import ConfigError, parse_app_config
from serve_app.config.placement import placement_problem
from workers.contract.model_config import ModelConfig


def model(**fields) -> ModelConfig:
    return ModelConfig(id="m", source="/models/m", **fields)


def test_a_split_cpu_replica_splits_its_cpus_over_one_bundle_a_shard():
    options = model(parallel={"tensor_parallel_size": 2}, deployment={"ray_actor_options": {"num_cpus": 2}}) \
        .worker_serve_options()
    assert options["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"]["num_cpus"] == 1.0  # the replica itself: bundle 0
    assert "placement_group_bundles" not in model().worker_serve_options()


def test_a_pipeline_replica_takes_one_bundle_a_stage():
    options = model(parallel={"pipeline_parallel_size": 4, "placement_group_strategy": "SPREAD"},
                    deployment={"ray_actor_options": {"num_cpus": 2}}).worker_serve_options()
    assert options["placement_group_bundles"] == [{"CPU": 0.5}] * 4
    assert options["placement_group_strategy"] == "SPREAD"


def test_a_replica_split_both_ways_takes_one_bundle_a_shard_of_every_stage():
    options = model(parallel={"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
                    deployment={"ray_actor_options": {"num_cpus": 2}}).worker_serve_options()
    assert options["placement_group_bundles"] == [{"CPU": 0.5}] * 4


def test_a_split_gpu_replica_takes_one_gpu_a_shard():
    options = model(device="cuda", parallel={"tensor_parallel_size": 4, "placement_group_strategy": "PACK"},
                    engine={"kv_cache_memory_gib": 8},
                    deployment={"ray_actor_options": {"num_gpus": 1, "num_cpus": 4}}).worker_serve_options()
    assert options["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1}] * 4
    assert options["placement_group_strategy"] == "PACK"


@pytest.mark.parametrize(("fields", "message"), [
    ({"parallel": {"tensor_parallel_size": 2}, "engine": {"direct_forward": False}}, "direct_forward: true"),
    ({"parallel": {"tensor_parallel_size": 2}, "device": "cuda", "deployment": {"ray_actor_options": {"num_gpus": 1}}},
     "kv_cache_memory_gib"),
])
def test_what_a_split_replica_cannot_do_is_a_config_error(fields, message):
    args = {"models": [{"id": "m", "source": "/models/m", **fields}]}
    with pytest.raises(ConfigError, match=message) as caught:
        parse_app_config(args)
    assert "models.0" in str(caught.value) and "parallel." in str(caught.value)


def test_a_tensor_group_no_node_holds_is_named_at_start():
    gpu_model = {"id": "big", "source": "/models/big", "device": "cuda", "engine": {"kv_cache_memory_gib": 8},
                 "parallel": {"tensor_parallel_size": 4}, "deployment": {"ray_actor_options": {"num_gpus": 1}}}
    config = parse_app_config({"models": [gpu_model]})
    two_nodes = [{"CPU": 16, "GPU": 2}, {"CPU": 16, "GPU": 2}]
    with pytest.raises(ConfigError, match=r"models\.0\.parallel\.tensor_parallel_size: 4 shards need 4 GPUs"):
        check_placement(config, two_nodes)
    assert "more than any one node has (2 GPUs" in placement_problem(config.models[0], two_nodes)
    spread = config.models[0].model_copy(update={"parallel": config.models[0].parallel.model_copy(
        update={"placement_group_strategy": "SPREAD"})})
    assert placement_problem(spread, two_nodes) is None  # four GPUs over the two nodes
    check_placement(config, [{"CPU": 32, "GPU": 8}])
    check_placement(config, [])  # no cluster to ask (not connected): Serve decides


def test_a_local_checkpoint_the_split_cannot_divide_is_named_at_start(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152}))
    config = parse_app_config({"models": [{"id": "m", "source": str(tmp_path), "parallel": {"tensor_parallel_size": 2}}]})
    with pytest.raises(ConfigError, match=r"models\.0\.parallel\.tensor_parallel_size: tensor_parallel_size 2 "
                       r"does not divide the model's 9 attention heads, 3 KV heads"):
        check_placement(config, [])
    three = parse_app_config({"models": [{"id": "m", "source": str(tmp_path), "parallel": {"tensor_parallel_size": 3}}]})
    check_placement(three, [])  # 9 heads, 3 KV heads, 1536: all divide by 3


def test_more_stages_than_layers_is_named_at_start(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 64, "intermediate_size": 128, "vocab_size": 300, "num_hidden_layers": 2}))
    config = parse_app_config({"models": [{"id": "m", "source": str(tmp_path), "parallel": {"pipeline_parallel_size": 3}}]})
    with pytest.raises(ConfigError, match=r"models\.0\.parallel\.pipeline_parallel_size: pipeline_parallel_size 3 is "
                       r"more than the model's 2 layers"):
        check_placement(config, [])
    both = {"pipeline_parallel_size": 2, "tensor_parallel_size": 3}
    config = parse_app_config({"models": [{"id": "m", "source": str(tmp_path), "parallel": both}]})
    with pytest.raises(ConfigError, match=r"models\.0\.parallel\.tensor_parallel_size: tensor_parallel_size 3 "):
        check_placement(config, [])
