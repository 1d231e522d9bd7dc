"""CUDA-only checks (skipped without a GPU; `make test-gpu` runs them on one): the Triton
paged decode kernel on the device, and the engine with decode CUDA graphs giving the same
greedy output as without them, as transformers' own generate, and under preemption."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from tests.support.engines import greedy_outputs, record_preemptions  # noqa: E402
from tests.support.tiny_models import build_tiny_llama  # noqa: E402
from workers.contract.sampling_params import SamplingParams  # noqa: E402
from workers.core.limits import EngineLimits  # noqa: E402
from workers.engine.llm_engine import LLMEngine  # noqa: E402
from workers.model.attention import register_paged_attention  # noqa: E402
from workers.model.fused_projections import fuse_sibling_projections  # noqa: E402
from workers.model.kv_cache import KVCacheShape  # noqa: E402

CUDA = torch.device("cuda")
VOCAB = 400


def _kernel_case(dtype, head_dim, group, seed, splits):
    from tests.unit.model.test_triton_attention import (
        CONTEXTS,
        make_case,
        reference,
        rel_err,
    )
    from workers.model.triton_attention import paged_decode_attention

    case = make_case(CONTEXTS, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, seed=seed)
    query, k, v, tables, lens = (t.to(CUDA) for t in case)
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, k, v, tables, lens.to(torch.int32), 16, scale, out=out, num_splits=splits)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    ref = reference(*(t.cpu() for t in (query, k, v, tables, lens)), scale)
    return rel_err(out.cpu(), ref)


@pytest.mark.parametrize("splits", [1, None])  # None: 16 context ranges for these 6 sequences
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 4), (80, 1)])
def test_triton_kernel_on_cuda(head_dim, group, splits):
    assert _kernel_case(torch.float32, head_dim, group, seed=head_dim, splits=splits) < 1e-5
    assert _kernel_case(torch.bfloat16, head_dim, group, seed=head_dim + 1, splits=splits) < 1e-2


def _model(dtype=torch.float32, fuse: bool = False):
    model = build_tiny_llama(VOCAB).to(device=CUDA, dtype=dtype)
    if fuse:  # q/k/v and gate/up as one multiply each, as the loader does
        assert fuse_sibling_projections(model) == 2 * model.config.num_hidden_layers
    model.set_attn_implementation(register_paged_attention())
    return model


def _engine(model, graphs: int, num_blocks: int = 512, block_size: int = 4, max_num_seqs: int = 64,
            async_scheduling: bool = False, eos: frozenset[int] = frozenset()) -> LLMEngine:
    per_token = KVCacheShape.from_model_config(model.config, model.dtype).bytes_per_token
    limits = EngineLimits(block_size=block_size, kv_cache_bytes=num_blocks * block_size * per_token,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=256,
                          cuda_graph_max_batch=graphs, async_scheduling=async_scheduling)
    return LLMEngine(model, eos, limits, CUDA)


def _prompts(count: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist()
            for n in torch.randint(1, 60, (count,), generator=gen)]


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused-projections"])
def test_graph_steps_match_eager_and_transformers(fuse):
    model = _model(fuse=fuse)
    reference = _model()  # the same weights (seeded), transformers' own projections
    prompts = _prompts(19)
    # Different lengths: the batch shrinks through several graph sizes (19 -> 16 -> 8 ...).
    max_tokens = [4 + 3 * i for i in range(len(prompts))]
    graphed = _engine(model, graphs=32)
    assert graphed.runner.decode_graphs is not None and graphed.runner.triton_decode
    eager = _engine(model, graphs=0)
    assert eager.runner.decode_graphs is None
    got = greedy_outputs(graphed, prompts, max_tokens)
    assert got == greedy_outputs(eager, prompts, max_tokens)
    for prompt, tokens, n in zip(prompts[:4], got, max_tokens):
        x = torch.tensor([prompt], device=CUDA)
        with torch.inference_mode():
            reference.set_attn_implementation("sdpa")
            ref = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                     eos_token_id=None, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist()


def test_graphs_under_preemption_keep_the_output():
    model = _model()
    prompts = _prompts(12, seed=5)
    max_tokens = [40] * len(prompts)
    roomy = greedy_outputs(_engine(model, graphs=16), prompts, max_tokens)
    tight = _engine(model, graphs=16, num_blocks=60)
    preempted = record_preemptions(tight)
    assert greedy_outputs(tight, prompts, max_tokens) == roomy
    assert preempted, "the small pool should have forced a preemption"


def test_bfloat16_graph_logits_match_eager():
    model = _model(torch.bfloat16)
    engine = _engine(model, graphs=16)
    prompts = _prompts(5, seed=7)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch.decodes and not batch.prefills
    graph_logits = engine.runner.forward(batch.decodes, [])[0].clone()
    graphs, engine.runner.decode_graphs = engine.runner.decode_graphs, None
    eager_logits = engine.runner.forward(batch.decodes, [])[0]
    engine.runner.decode_graphs = graphs
    err = (graph_logits - eager_logits).norm() / eager_logits.norm()
    assert err < 2e-2, err


def test_deployment_path_captures_graphs(tmp_path):
    from tests.support.tiny_models import write_tiny_model_dir
    from workers.contract.model_config import ModelConfig
    from workers.serving.engine_build import build_engine

    model_dir = write_tiny_model_dir(tmp_path / "tiny")
    config = ModelConfig(id="tiny", source=str(model_dir), device="cuda", dtype="float32",
                         engine={"max_num_seqs": 24, "kv_cache_memory_gib": 0.05},
                         deployment={"ray_actor_options": {"num_gpus": 1}})
    engine = build_engine(config).engine
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 24]  # capped by max_num_seqs
    assert all(len(t) == 6 for t in greedy_outputs(engine, _prompts(3), [6] * 3))


@pytest.mark.parametrize("window,softcap,splits", [(7, None, 1), (70, 1.5, None)])
def test_triton_kernel_window_and_softcap_on_cuda(window, softcap, splits):
    from tests.unit.model.test_triton_attention import (
        CONTEXTS,
        make_case,
        reference,
        rel_err,
    )
    from workers.model.triton_attention import paged_decode_attention

    case = make_case(CONTEXTS, num_kv_heads=2, group=4, head_dim=64, dtype=torch.float32, seed=9)
    query, k, v, tables, lens = (t.to(CUDA) for t in case)
    out = paged_decode_attention(query, k, v, tables, lens, 16, 0.125, num_splits=splits, sliding_window=window,
                                 softcap=softcap)
    ref = reference(*case, 0.125, window, softcap)
    assert rel_err(out.cpu(), ref) < 1e-5


def test_graphs_with_sliding_window_and_softcap_match_transformers():
    """Gemma 2's shape (soft-capped logits, a sliding and a full layer) through graphed
    decode steps, against transformers' eager generate on the CPU."""
    from tests.unit.model.test_model_families import (
        assert_same,
        engine_outputs,
        gemma2,
        prompts,
        reference,
    )

    model = gemma2()
    paged = gemma2().to(CUDA)
    paged.set_attn_implementation(register_paged_attention())
    engine = _engine(paged, graphs=8, num_blocks=64)
    assert engine.runner.decode_graphs is not None
    batch, max_tokens = prompts(), [12, 14, 9, 10]
    for got, prompt, n in zip(engine_outputs(engine, batch, max_tokens), batch, max_tokens):
        assert_same(got, reference(model, prompt, n))


@pytest.mark.parametrize("graphs", [32, 0], ids=["graphs", "eager"])
def test_async_scheduling_matches_sync_on_cuda(graphs):
    """Steps launched from the previous step's ids on the device (pinned async copy, event
    wait) give the synchronous engine's output, with stops mid-pipeline and a tight pool."""
    from tests.unit.engine.test_async_scheduling import _run

    model = _model()
    prompts = _prompts(19, seed=11)
    free_run = greedy_outputs(_engine(model, graphs=graphs), prompts, [30] * len(prompts))
    eos = frozenset({free_run[0][9]})
    requests = [(p, SamplingParams(max_tokens=10 + i, temperature=0.0)) for i, p in enumerate(prompts)]
    sync = _run(_engine(model, graphs=graphs, eos=eos, num_blocks=120), requests)
    fast_engine = _engine(model, graphs=graphs, eos=eos, num_blocks=120, async_scheduling=True)
    assert _run(fast_engine, requests) == sync
    assert fast_engine.async_steps > 0
    assert any(events[-1][2] == "stop" for events in sync)


@pytest.mark.parametrize("graphs", [32, 0], ids=["graphs", "eager"])
def test_lora_rows_on_cuda_match_peft_merged(graphs, tmp_path):
    """LoRA on the device: decode steps replay the LoRA graphs (the slot index a graph input)
    or run eagerly (row runs); three adapters and the base in one batch, each equal to
    peft's merged model."""
    from tests.support.lora_adapters import (
        merged_greedy,
        merged_model,
        write_peft_adapter,
    )
    from workers.contract.lora import LoraRequest
    from workers.core.limits import LoraLimits
    from workers.lora.peft_files import read_peft_adapter

    cpu_base = build_tiny_llama(VOCAB)
    dirs = [write_peft_adapter(cpu_base, tmp_path / f"a{i}", seed=i, rank=2 + 2 * i) for i in range(3)]
    model = _model(fuse=True)
    per_token = KVCacheShape.from_model_config(model.config, model.dtype).bytes_per_token
    limits = EngineLimits(block_size=4, kv_cache_bytes=512 * 4 * per_token, max_num_seqs=64,
                          max_num_batched_tokens=512, max_model_len=256, cuda_graph_max_batch=graphs,
                          lora=LoraLimits(max_loras=4, max_rank=8))
    engine = LLMEngine(model, frozenset(), limits, CUDA)
    assert (engine.runner.decode_graphs is not None) == bool(graphs)
    requests = [LoraRequest.of(f"a{i}", str(d)) for i, d in enumerate(dirs)]
    for request in requests:
        engine.add_lora(read_peft_adapter(request))
    prompts = _prompts(8)
    keys = [None, requests[0].key, requests[1].key, requests[2].key] * 2
    outputs = greedy_outputs(engine, prompts, [6] * len(prompts), keys)
    references = [cpu_base] + [merged_model(cpu_base, d) for d in dirs]
    for tokens, prompt, key in zip(outputs, prompts, keys):
        reference = references[0 if key is None else 1 + [r.key for r in requests].index(key)]
        assert tokens == merged_greedy(reference, prompt, 6)
