"""The decode CUDA-graph runner's host side on CPU: batch-size buckets, static buffers
refilled per replay, padding rows, the padding block, the memory reserve, the config.

A CUDA graph cannot be captured without a GPU, so the engine test swaps each graph's
replay for an eager call of the very function the graph would capture (`_forward` over
the static buffers). Attention inside it is the Triton kernel, run by Triton's
interpreter: that needs TRITON_INTERPRET=1 from process start, so that test runs in a
child pytest (as tests/unit/model/test_triton_attention.py does). tests/gpu/test_gpu.py checks real
capture and replay on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support.engines import greedy_outputs
from tests.support.paths import REPO_ROOT
from workers.contract.model_config import EngineConfig, ModelConfig
from workers.contract.sampling_params import SamplingParams
from workers.core.batch import ScheduledChunk
from workers.core.limits import EngineLimits, LoraLimits
from workers.core.sequence import Sequence
from workers.engine.kv_sizing import cuda_graph_reserve
from workers.engine.llm_engine import LLMEngine
from workers.model.cuda_graphs import DecodeGraphs, graph_batch_sizes
from workers.model.kv_cache import KVCacheShape, PagedKVCache
from workers.model.runner import ModelRunner
from workers.model.step_inputs import decode_block_tables

ROOT = REPO_ROOT
CPU = torch.device("cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
VOCAB = 400


def test_batch_size_buckets():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def _seq(seq_id: int, tokens: list[int], blocks: list[int]) -> Sequence:
    seq = Sequence(seq_id, tokens, SamplingParams(max_tokens=4), frozenset(), max_model_len=64)
    seq.block_table = blocks
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def test_block_tables_hold_context_blocks_and_padding_rows():
    # Context 5 of block size 4 -> 2 blocks (a third, reserved ahead, is left out).
    a = ScheduledChunk.of(_seq(0, [1, 2, 3, 4, 5], [7, 3, 9]), 1)
    b = ScheduledChunk.of(_seq(1, [1, 2], [4]), 1)
    tables = decode_block_tables([a, b], [5, 2], 4, pad_block=99, rows=4)
    assert tables.tolist() == [[7, 3], [4, 99], [99, 99], [99, 99]]


def test_padding_block_is_outside_the_pool():
    shape = KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    plain = PagedKVCache(shape, num_blocks=3, block_size=4, device=CPU)
    padded = PagedKVCache(shape, num_blocks=3, block_size=4, device=CPU, padding_block=True)
    assert plain.padding_block is None and padded.padding_block == 3
    assert padded.keys.shape[1] == 4 * 4 and padded.nbytes == plain.nbytes * 4 // 3


def test_graph_reserve_and_config():
    limits = EngineLimits(max_num_seqs=64, cuda_graph_max_batch=256)
    assert cuda_graph_reserve(limits, 1000) == 64 * 1000 * 10 + 256 * 1024**2  # capped by max_num_seqs
    assert cuda_graph_reserve(EngineLimits(), 1000) == 0  # off by default in the engine
    assert EngineConfig().cuda_graph_max_batch_size == 256 and EngineConfig().async_scheduling
    with pytest.raises(ValueError):
        EngineConfig(cuda_graph_max_batch_size=-1)
    config = ModelConfig(id="m", engine={"cuda_graph_max_batch_size": 0})
    assert config.engine.cuda_graph_max_batch_size == 0


def test_cpu_engine_captures_nothing(paged_model):
    per_token = KVCacheShape.from_model_config(paged_model.config, paged_model.dtype).bytes_per_token
    limits = EngineLimits(block_size=4, kv_cache_bytes=64 * 4 * per_token, cuda_graph_max_batch=256)
    engine = LLMEngine(paged_model, frozenset(), limits, CPU)
    assert engine.runner.decode_graphs is None and not engine.runner.triton_decode
    assert engine.kv_cache.padding_block is None


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU tests/gpu/test_gpu.py captures real graphs")
def test_graph_runner_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", __file__,
           "-k", "interpreted"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "2 passed" in result.stdout, result.stdout[-2000:]


class _EagerReplay:
    """Stands in for a captured graph: runs what capture recorded, on the same buffers."""

    def __init__(self, graphs: DecodeGraphs, size: int, with_lora: bool, calls: list[tuple[int, int]]) -> None:
        self.graphs, self.size, self.with_lora, self.calls = graphs, size, with_lora, calls
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.calls.append((self.size, int((self.graphs.slots[: self.size] != self.graphs.pad_slot).sum())))
        self.graphs._forward(self.size, self.with_lora)


def _engine(model, graphs: bool, num_blocks: int, lora: LoraLimits | None = None) -> tuple[LLMEngine, list]:
    per_token = KVCacheShape.from_model_config(model.config, model.dtype).bytes_per_token
    limits = EngineLimits(block_size=4, kv_cache_bytes=num_blocks * 4 * per_token, max_num_seqs=16,
                          max_model_len=128, lora=lora)
    engine = LLMEngine(model, frozenset(), limits, CPU)
    calls: list[tuple[int, int]] = []
    if graphs:  # what LLMEngine does on CUDA, with eager replays
        engine.kv_cache = PagedKVCache(engine.kv_cache.shape, num_blocks, 4, CPU, padding_block=True)
        engine.runner = ModelRunner(model, engine.kv_cache, CPU, triton_decode=True, lora=engine.lora)
        runner = DecodeGraphs(model, engine.kv_cache, 16, limits.max_model_len, engine.vocab_size, engine.lora)
        variants = (False, True) if lora is not None else (False,)
        runner.graphs = {(s, v): _EagerReplay(runner, s, v, calls) for s in runner.sizes for v in variants}
        engine.runner.decode_graphs = runner
    return engine, calls


@pytest.fixture
def few_splits(monkeypatch):
    """The interpreted kernel with a small grid: split-K decode is the kernel test's subject
    (tests/unit/model/test_triton_attention.py); here each interpreted step costs ~6x less
    (the two tests 33 s -> 5 s) and still splits small batches."""
    from workers.model import triton_attention

    monkeypatch.setattr(triton_attention, "_CPU_SM_COUNT", 4)


@pytest.mark.skipif(not INTERPRETED, reason="run in a child by test_graph_runner_under_interpreter")
def test_interpreted_graph_steps_match_the_sdpa_engine(few_splits):
    """Fused projections (the default) only: separate ones feed the same static buffers
    through more layers, and each interpreted run costs ~15 s of the suite."""
    import copy

    from tests.support.tiny_models import build_tiny_llama
    from workers.model.attention import register_paged_attention
    from workers.model.fused_projections import fuse_sibling_projections

    model = build_tiny_llama(VOCAB)
    model.set_attn_implementation(register_paged_attention())
    graphed_model = copy.deepcopy(model)
    # The graphs' static buffers feed q/k/v and gate/up as one multiply each.
    assert fuse_sibling_projections(graphed_model) == 2 * model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 1, 30, 9, 12, 3)]
    # The batch shrinks: 7 rows, then 6 (graph size 8), 4, 2, 1 (each interpreted step costs seconds).
    max_tokens = [2, 5, 3, 2, 4, 1, 3]
    reference, _ = _engine(model, graphs=False, num_blocks=128)
    graphed, calls = _engine(graphed_model, graphs=True, num_blocks=128)
    # Poison the pool: a row that read a slot it never wrote would turn the logits NaN.
    graphed.kv_cache.keys.fill_(float("nan"))
    graphed.kv_cache.values.fill_(float("nan"))
    assert greedy_outputs(graphed, prompts, max_tokens) == greedy_outputs(reference, prompts, max_tokens)
    assert {size for size, _ in calls} >= {8, 4, 2, 1}
    assert any(live < size for size, live in calls), "some replay ran padding rows"
    # Padding rows wrote only the padding block: every other slot is NaN or was written by a sequence.
    assert not graphed.kv_cache.keys[:, : 128 * 4].isnan().all()


@pytest.mark.skipif(not INTERPRETED, reason="run in a child by test_graph_runner_under_interpreter")
def test_interpreted_lora_graph_steps_match_the_eager_lora_engine(tmp_path, few_splits):
    """Graph decode steps read each row's adapter slot from the static input buffer: rows of
    three adapters and of none in one replay give the eager (segment) path's tokens."""
    import copy

    from tests.support.lora_adapters import write_peft_adapter
    from tests.support.tiny_models import build_tiny_llama
    from workers.contract.lora import LoraRequest
    from workers.lora.peft_files import read_peft_adapter
    from workers.model.attention import register_paged_attention
    from workers.model.fused_projections import fuse_sibling_projections

    base = build_tiny_llama(VOCAB)
    adapters = [read_peft_adapter(LoraRequest.of(f"a{i}", str(write_peft_adapter(base, tmp_path / f"a{i}", seed=i))))
                for i in range(3)]
    base.set_attn_implementation(register_paged_attention())
    graphed_model = copy.deepcopy(base)
    fuse_sibling_projections(graphed_model)
    lora = LoraLimits(max_loras=4, max_rank=4)
    reference, _ = _engine(base, graphs=False, num_blocks=128, lora=lora)
    graphed, _ = _engine(graphed_model, graphs=True, num_blocks=128, lora=lora)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 1, 30, 9)]
    keys = [adapters[0].key, None, adapters[1].key, adapters[2].key, adapters[0].key]
    outputs = []
    for engine in (reference, graphed):
        for adapter in adapters:
            engine.add_lora(adapter)
        outputs.append(greedy_outputs(engine, prompts, [3] * len(prompts), keys))
    assert outputs[0] == outputs[1]
    replays = {variant: sum(g.replays for (_, v), g in graphed.runner.decode_graphs.graphs.items() if v == variant)
               for variant in (False, True)}
    assert replays[True] > 0, "decode steps with adapter rows replayed the LoRA graphs"
