"""Tensor-parallel runs for tests: the same models and requests on one process, or split
over a gloo group of spawned processes by tensors, by layers or both (shard 0 drives an
engine, the others run workers/parallel/shard_loop.py), so their outputs can be compared."""

from __future__ import annotations

import copy
import json
import traceback

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.support.engines import make_engine, run_to_completion, tokens_by_choice
from tests.support.tiny_models import build_tiny_llama, build_tokenizer
from tests.unit.model.test_direct_forward import _with_vectors, llama, qwen3_head_norms
from tests.unit.model.test_model_families import SHAPE, gemma2, prompts
from workers.contract.lora import LoraRequest
from workers.contract.model_shape import SplitShape, is_direct_family, split_problem
from workers.contract.sampling_params import GuidedDecoding, SamplingParams
from workers.core.limits import LoraLimits
from workers.lora.manager import LORA_TARGETS
from workers.lora.peft_files import LoraAdapter, LoraModule
from workers.model.attention import register_paged_attention
from workers.model.cpu_linear import pack_linear_layers
from workers.model.fused_projections import fuse_sibling_projections
from workers.parallel import micro_batches
from workers.parallel.pipeline import StageLayers
from workers.parallel.shard_group import ShardGroup, ShardLayout, TensorRank
from workers.parallel.shard_loop import ShardLoop
from workers.parallel.tensor_split import (
    TensorSplitError,
    apply_cut,
    cut_for,
    set_parameter,
    sync_module_sizes,
)

CPU = torch.device("cpu")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _tokenizer_llama():
    tokenizer = build_tokenizer()
    return build_tiny_llama(len(tokenizer), seed=3), tokenizer


def _three_layer_llama():
    return _with_vectors(LlamaForCausalLM(LlamaConfig(**{**SHAPE, "num_hidden_layers": 3}))), None


# (name, model builder, step token budget, packed weights): chunked prefill where the budget is 5.
CASES = [
    ("llama", lambda: (llama(), None), 64, False),
    ("llama-chunked-packed", lambda: (llama(), None), 5, True),
    ("qwen3-chunked", lambda: (qwen3_head_norms(), None), 5, False),
    ("llama-tokenizer-guided", _tokenizer_llama, 64, False),
    # transformers' forward with its tensor-parallel plan: soft caps, local and global layers.
    ("gemma2-chunked", lambda: (gemma2(), None), 5, False),
]
# Pipeline stages: three layers over two stages (two and one), and Qwen3.
PIPELINE_CASES = [
    ("pp-llama-3-layers-chunked-packed", _three_layer_llama, 5, True),
    ("pp-qwen3", lambda: (qwen3_head_norms(), None), 64, False),
    ("pp-llama-tokenizer-guided", _tokenizer_llama, 64, False),
]
# Two pipeline stages of two tensor shards each.
TENSOR_PIPELINE_CASES = [
    ("tp-pp-llama-3-layers-chunked-packed", _three_layer_llama, 5, True),
    ("tp-pp-llama-tokenizer-guided", _tokenizer_llama, 64, False),
    ("tp-pp-qwen3-chunked", lambda: (qwen3_head_norms(), None), 5, False),
]
# Each way to split: its shard layout and its cases.
SPLITS = {
    "tensor": (ShardLayout(tensor=2), CASES),
    "pipeline": (ShardLayout(stages=2), PIPELINE_CASES),
    "tensor-x-pipeline": (ShardLayout(tensor=2, stages=2), TENSOR_PIPELINE_CASES),
}


def split_model(model: torch.nn.Module, position: TensorRank) -> None:
    """Cut an unfused, unpacked `model` in memory down to `position`'s part, in place: the
    plan sliced_load.py reads a checkpoint by, on a model the tests build."""
    if position.world == 1:
        return
    kinds = [type(model).__name__]
    reason = split_problem(model.config, position.world, kinds)
    if reason is not None:
        raise TensorSplitError(reason)
    shape = SplitShape.of(model.config)
    vocab_split = is_direct_family(model.config, kinds)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        part = apply_cut(param.detach(), cut_for(name, shape, position, vocab_split))
        if part is not param:
            set_parameter(model, name, part.clone())
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    sync_module_sizes(model)


def prepared_part(model, position: TensorRank, pack: bool, stage: StageLayers | None = None):
    """`model` cut to `position`'s part (of `stage`'s layers: the others' weights on the
    meta device, as sliced_load.py leaves them), fused, packed when asked, on the paged
    attention (the order the worker loads a part in: workers/serving/model_part.py)."""
    model = copy.deepcopy(model)
    split_model(model, position)
    if stage is not None:
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        for name, param in list(model.named_parameters()):
            if not stage.holds(name, tied):
                set_parameter(model, name, torch.empty_like(param, device="meta"))
    fuse_sibling_projections(model)
    if pack:
        pack_linear_layers(model, float32=True)
    model.set_attn_implementation(register_paged_attention())
    return model


def random_adapters(model: torch.nn.Module, count: int = 2, rank: int = 4) -> list[LoraAdapter]:
    """`count` adapters of the whole `model` (before any cut), on every LoRA target of
    every layer, with random A and B of a size that moves the greedy tokens."""
    generator = torch.Generator().manual_seed(11)
    adapters = []
    for index in range(count):
        modules = {}
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(module, torch.nn.Linear):
                modules[name] = LoraModule(torch.randn(rank, module.in_features, generator=generator) * 0.3,
                                           torch.randn(module.out_features, rank, generator=generator) * 0.3)
        adapters.append(LoraAdapter(LoraRequest.of(f"adapter-{index}", f"/in-memory/{index}"), modules))
    return adapters


def lora_rows(engine, adapters: list[LoraAdapter]) -> list[list[tuple[int, float]]]:
    """Greedy rows over two adapters and the base in one batch, and one alone later (its
    adapter written into a slot again after the other took it: one slot fewer than adapters)."""
    for adapter in adapters:
        engine.add_lora(adapter)
    batch = prompts()
    keys = [adapters[0].key, None, adapters[1].key, adapters[0].key]
    ids = [engine.add_request(batch[i], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0),
                              lora=keys[i]) for i in range(4)]
    events = run_to_completion(engine)
    return [[(e.token_id, e.logprob) for e in events[i]] for i in ids]


def mixed_rows(engine, shared: list[int]) -> list[list[tuple[int, float]]]:
    """16 greedy prompts of mixed lengths (3 to 40 tokens, some opening with `shared`, whose
    blocks the cache holds) in one batch: every token and logprob."""
    generator = torch.Generator().manual_seed(5)
    vocab = engine.vocab_size
    batch = []
    for i in range(16):
        length = 3 + (i * 7) % 38
        fresh = torch.randint(3, min(vocab, 300), (length,), generator=generator).tolist()
        batch.append(shared[:12] + fresh if i % 4 == 0 else fresh)
    ids = [engine.add_request(p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0))
           for p in batch]
    events = run_to_completion(engine)
    return [[(e.token_id, e.logprob) for e in events[i]] for i in ids]


def workload(engine, tokenizer, adapters: list[LoraAdapter] | None = None) -> dict:
    """Greedy rows (one alone first, so a later one hits its prefix in the cache), 16 rows
    of mixed lengths in one batch, a seeded n=2 request, a JSON-schema row when there is a tokenizer, and rows over LoRA adapters
    when given: every token and logprob."""
    batch, max_tokens = prompts(), [12, 14, 9, 10]
    out: dict = {"greedy": []}
    for rows in ([0], [1, 2, 3]):
        ids = [engine.add_request(batch[i], SamplingParams(max_tokens=max_tokens[i], temperature=0.0,
                                                           ignore_eos=True, logprobs=0)) for i in rows]
        events = run_to_completion(engine)
        out["greedy"] += [[(e.token_id, e.logprob) for e in events[i]] for i in ids]
    out["mixed"] = mixed_rows(engine, batch[0])
    sampled = engine.add_request(batch[0][:9], SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=7,
                                                              ignore_eos=True))
    out["n2"] = tokens_by_choice(run_to_completion(engine)[sampled])
    if tokenizer is not None:
        guided = SamplingParams(max_tokens=40, temperature=0.0, guided=GuidedDecoding("json_schema", json.dumps(SCHEMA)))
        request = engine.add_request(tokenizer.encode("Name and age:"), guided)
        out["guided"] = [e.token_id for e in run_to_completion(engine)[request]]
    out["hit_tokens"] = engine.blocks.hit_tokens
    if adapters:
        out["lora"] = lora_rows(engine, adapters)
    return out


def engine_for(model, budget: int, tokenizer=None, group: ShardGroup | None = None,
               stage: StageLayers | None = None, lora: bool = False):
    """`lora`: with one LoRA slot fewer than the adapters random_adapters makes, of rank 4."""
    limits = LoraLimits(max_loras=1, max_rank=4) if lora else None
    return make_engine(model, num_blocks=64, max_num_batched_tokens=budget, tokenizer=tokenizer, shard_group=group,
                       stage=stage, lora=limits)


def reference(case, lora: bool = False) -> dict:
    name, build, budget, pack = case
    model, tokenizer = build()
    adapters = random_adapters(model) if lora else None
    engine = engine_for(prepared_part(model, TensorRank(0, 1), pack), budget, tokenizer, lora=lora)
    return workload(engine, tokenizer, adapters)


def process_placements() -> dict[str, int]:
    """Each split's first process among max(world) spawned ones: the narrower splits side by
    side (two 2-rank splits at once on 4 processes), the widest after them on all."""
    widest = max(layout.world for layout, _ in SPLITS.values())
    placements, next_free = {}, 0
    for split, (layout, _) in SPLITS.items():
        if layout.world == widest:
            placements[split] = 0
            continue
        if next_free + layout.world > widest:
            next_free = 0
        placements[split], next_free = next_free, next_free + layout.world
    return placements


def run_rank(process: int, init_methods: dict[str, str], results) -> None:
    """Spawned process number `process`: its rank in each split that process_placements puts
    it in, one split after the other (a key of `init_methods` each, on a group of its own);
    each case's outputs go to `results` as (split, case name, outputs). One set of processes
    for every split: each one's start (torch, transformers) costs seconds of CPU."""
    try:
        torch.set_num_threads(1)
        micro_batches.MIN_MICRO_BATCH_TOKENS = 1  # so that these small steps are cut too
        placements = process_placements()
        for split, init_method in init_methods.items():
            layout, cases = SPLITS[split]
            shard = process - placements[split]
            if 0 <= shard < layout.world:
                _run_split(shard, split, layout, cases, init_method, results)
    except BaseException:  # noqa: BLE001 - the test reads what went wrong
        results.put(("error", None, f"process {process}: {traceback.format_exc()}"))
        raise


def _run_split(shard: int, split: str, layout: ShardLayout, cases, init_method: str, results) -> None:
    # 120 s: the widest split's group forms once its processes' earlier splits are done.
    group = ShardGroup(shard, layout, init_method, CPU, timeout_s=120)
    for name, build, budget, pack in cases:
        model, tokenizer = build()
        stage = None
        if layout.stages > 1:
            stage = StageLayers.of(group.stage, layout.stages, model.config.num_hidden_layers)
        adapters = random_adapters(model)
        part = prepared_part(model, group.position, pack, stage)
        if group.is_driver:
            engine = engine_for(part, budget, tokenizer, group, stage, lora=True)
            results.put((split, name, workload(engine, tokenizer, adapters)))
            engine.close()
        else:
            ShardLoop(part, group, CPU, stage).run()
    group.close()
