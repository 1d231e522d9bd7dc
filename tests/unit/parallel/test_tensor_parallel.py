"""Tensor and pipeline parallelism (workers/parallel/): a model split over gloo shards (two
tensor shards, two pipeline stages, or two stages of two tensor shards each) gives what
the whole model gives on one process: the same greedy tokens with log-probabilities within
float tolerance, through 16 prompts of mixed lengths in one batch, chunked prefill, prefix-cache hits, packed weights, a Qwen3
model's head norms, a seeded n=2 request, a JSON-schema row and rows over two LoRA
adapters sharing one slot; and the split refuses what it cannot divide."""

from __future__ import annotations

import copy
import queue

import pytest
import torch
import torch.multiprocessing as mp
from transformers import Phi3Config

from tests.support.tensor_parallel import SPLITS, reference, run_rank, split_model
from tests.unit.model.test_direct_forward import llama, qwen3_head_norms
from tests.unit.model.test_model_families import SHAPE, gemma2
from workers.contract.model_shape import split_problem, stage_problem
from workers.parallel.pipeline import StageLayers
from workers.parallel.shard_group import TensorRank, free_init_method
from workers.parallel.sliced_load import load_split_model
from workers.parallel.tensor_split import TensorSplitError


@pytest.fixture(scope="module")
def split_runs() -> tuple[dict[str, dict], dict[str, dict]]:
    """(references, outputs), each {split: {case name: outputs}}: every split's cases run by
    one set of spawned processes (as many as the widest split), the references here while
    they run (their imports take seconds)."""
    world = max(layout.world for layout, _ in SPLITS.values())
    context = mp.get_context("spawn")
    results = context.Queue()
    init_methods = {split: free_init_method() for split in SPLITS}
    ranks = [context.Process(target=run_rank, args=(shard, init_methods, results)) for shard in range(world)]
    for process in ranks:
        process.start()
    expected = sum(len(cases) for _, cases in SPLITS.values())
    outputs: dict[str, dict] = {split: {} for split in SPLITS}
    try:
        references = {split: {case[0]: reference(case, lora=True) for case in cases}
                      for split, (_, cases) in SPLITS.items()}
        for _ in range(expected):
            split, name, value = results.get(timeout=240)
            assert split != "error", value
            outputs[split][name] = value
    except queue.Empty:
        pytest.fail(f"the split runs gave {sum(map(len, outputs.values()))} of {expected} cases within the time")
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert all(process.exitcode == 0 for process in ranks)
    return references, outputs


@pytest.mark.parametrize("split", list(SPLITS))
def test_a_split_model_gives_the_whole_models_tokens_and_logprobs(split, split_runs):
    cases = SPLITS[split][1]
    references, outputs = split_runs[0][split], split_runs[1][split]
    for case in cases:
        name = case[0]
        want, got = references[name], outputs[name]
        assert want["hit_tokens"] > 0 and got["hit_tokens"] == want["hit_tokens"], name
        assert len(got["mixed"]) == 16, name
        for w, g in zip(want["greedy"] + want["mixed"], got["greedy"] + got["mixed"], strict=True):
            assert [t for t, _ in g] == [t for t, _ in w], name
            assert max(abs(a - b) for (_, a), (_, b) in zip(g, w)) < 1e-4, name
        assert got["n2"] == want["n2"] and len(got["n2"]) == 2, name
        assert got.get("guided") == want.get("guided"), name
        # The adapter moves the log-probabilities (or tokens) of the prompt the first greedy row has.
        assert want["lora"][0] != want["greedy"][0][:8], name
        assert "lora" in got, name
        for w, g in zip(want.get("lora", []), got.get("lora", []), strict=True):
            assert [t for t, _ in g] == [t for t, _ in w], name
            assert max(abs(a - b) for (_, a), (_, b) in zip(g, w)) < 1e-4, name
    guided = next(value["guided"] for name, value in outputs.items() if name.endswith("tokenizer-guided"))
    assert guided, "the guided row produced tokens"


def test_a_split_shard_holds_its_part():
    model = llama()
    attn = model.model.layers[0].self_attn
    whole_k = attn.k_proj.weight.detach().clone()
    whole_o = attn.o_proj.weight.detach().clone()
    split_model(model, TensorRank(1, 2))
    head_dim = attn.head_dim  # 4 heads, 2 KV heads: rank 1 keeps q heads 2-3 and KV head 1
    assert attn.q_proj.weight.shape[0] == 2 * head_dim and attn.q_proj.out_features == 2 * head_dim
    assert torch.equal(attn.k_proj.weight, whole_k[head_dim : 2 * head_dim])
    assert torch.equal(attn.o_proj.weight, whole_o[:, 2 * head_dim : 4 * head_dim])
    assert model.lm_head.weight.shape[0] == model.config.vocab_size // 2


def test_what_the_split_cannot_divide_is_named():
    model = llama()
    kinds = ["LlamaForCausalLM"]
    assert "does not divide the model's 4 attention heads, 2 KV heads" in split_problem(model.config, 3, kinds)
    assert split_problem(model.config, 2, kinds) is None
    with pytest.raises(TensorSplitError, match="KV heads"):
        split_model(model, TensorRank(0, 4))
    assert split_problem(gemma2().config, 2) is None  # transformers' plan: split through its forward
    assert "column/row tensor-parallel plan" in split_problem(Phi3Config(**SHAPE), 2, ["Phi3ForCausalLM"])
    assert "families only" in stage_problem(gemma2().config, 2)


@pytest.mark.parametrize("build", [qwen3_head_norms, gemma2], ids=["qwen3", "gemma2-transformers-plan"])
def test_a_shard_reads_only_its_slices_of_a_checkpoint(tmp_path, build):
    """sliced_load.py gives the same part as cutting the whole model in memory (a plan
    family keeps its vocabulary whole)."""
    model = build()
    model.save_pretrained(tmp_path)
    for rank in range(2):
        position = TensorRank(rank, 2)
        cut = copy.deepcopy(model)
        split_model(cut, position)
        read = load_split_model(tmp_path, position, torch.float32, "cpu")
        want, got = dict(cut.state_dict()), dict(read.state_dict())
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), name
        buffers = dict(read.named_buffers())  # computed, not read: rotary frequencies, Gemma's embedding scale
        for name, buffer in cut.named_buffers():
            assert torch.allclose(buffers[name], buffer), name
        vocab = model.config.vocab_size
        assert read.lm_head.out_features == (vocab if build is gemma2 else vocab // 2)


def test_the_vocabulary_splits_in_equal_parts_but_the_last():
    assert [TensorRank(r, 2).vocab_range(301) for r in range(2)] == [(0, 151), (151, 301)]
    assert [TensorRank(r, 4).vocab_range(10) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_stages_take_the_layers_in_order_the_first_ones_more():
    assert [StageLayers.of(s, 3, 8).layers for s in range(3)] == [range(0, 3), range(3, 6), range(6, 8)]
    stage = StageLayers.of(1, 2, 3)
    assert stage.holds("model.layers.2.mlp.down_proj.weight", tied=False)
    assert not stage.holds("model.layers.1.mlp.down_proj.weight", tied=False)
    assert stage.holds("lm_head.weight", tied=False) and stage.holds("model.norm.weight", tied=False)
    assert stage.holds("model.embed_tokens.weight", tied=True)  # the last stage's head is the embedding
    assert not stage.holds("model.embed_tokens.weight", tied=False)


def test_a_stage_reads_only_its_layers_of_a_checkpoint(tmp_path):
    model = qwen3_head_norms()
    model.save_pretrained(tmp_path)
    stage = StageLayers.of(1, 2, model.config.num_hidden_layers)
    read = load_split_model(tmp_path, TensorRank(0, 1), torch.float32, "cpu", stage=stage)
    whole = dict(model.state_dict())
    for name, param in read.named_parameters():
        if stage.holds(name, bool(model.config.tie_word_embeddings)):
            assert torch.equal(param, whole[name]), name
        else:
            assert param.is_meta, name  # never read


def test_a_shard_of_a_model_split_both_ways_loads_its_stages_part(tmp_path):
    """Shard 3 of two stages of two tensor shards: tensor rank 1 of the last stage."""
    from workers.contract.model_config import ModelConfig
    from workers.serving.model_part import load_part

    model = qwen3_head_norms()
    model.save_pretrained(tmp_path)
    config = ModelConfig(id="m", source=str(tmp_path), dtype="float32", pack_cpu_weights=False,
                         parallel={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    loaded, stage = load_part(config, 3)
    assert stage == StageLayers.of(1, 2, model.config.num_hidden_layers)
    cut = copy.deepcopy(model)
    split_model(cut, TensorRank(1, 2))
    want = dict(cut.state_dict())
    layer = f"model.layers.{stage.start}.self_attn.o_proj.weight"
    assert torch.equal(loaded.model.get_parameter(layer), want[layer])
    assert loaded.model.get_parameter("model.layers.0.self_attn.o_proj.weight").is_meta
