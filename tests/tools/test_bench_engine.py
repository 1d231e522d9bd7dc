"""tools.bench.engine's modes: `worker` (the worker's request path in one process), `direct`
(transformers' forward against the direct forward), `lora`, `fused`; and the limits the offline
engine takes."""

from __future__ import annotations

import asyncio
import re

import gguf
import pytest

from tools.bench import engine as bench_engine


def test_worker_mode_runs_the_load_through_the_request_path(tiny_model_dir, capsys):
    bench_engine.main(["--source", str(tiny_model_dir), "worker", "--concurrency", "1", "3",
                       "--num-requests", "5", "--max-tokens", "4", "--prompt", "Hello there"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("worker ")]
    assert [re.search(r"c=(\d+)\s+n=(\d+)", line).groups() for line in lines] == [("1", "5"), ("3", "5")]
    for line in lines:
        tok_s = float(re.search(r"tok/s=\s*([\d.]+)", line).group(1))
        tpot = float(re.search(r"TPOT med=\s*([\d.]+)", line).group(1))
        assert tok_s > 0 and tpot > 0


@pytest.mark.parametrize("concurrency", [1, 4])
def test_worker_level_counts_every_token(tiny_model_dir, concurrency):
    async def run():
        engine, processor = await bench_engine.start_worker(str(tiny_model_dir))
        try:
            return await bench_engine.worker_level(processor, "Hi", concurrency, 6, 5)
        finally:
            engine.stop()

    report = asyncio.run(run())
    assert report.requests == 6 and report.concurrency == concurrency
    assert report.output_tok_s * report.wall_s == pytest.approx(6 * 5)


def test_offline_engine_schedules_as_the_serve_config_says(tiny_model):
    """The offline baseline must run the Serve path's step budget, prefill cap, sequence
    cap and KV pool, or "Serve path / engine offline" compares two schedulers."""
    config = bench_engine.served_model_config(bench_engine.SERVE_CONFIG)
    engine = bench_engine.configured_engine(tiny_model, config)
    assert (engine.limits.max_num_batched_tokens, engine.limits.max_prefill_tokens_while_decoding,
            engine.limits.max_num_seqs) == (config.engine.max_num_batched_tokens,
                                            config.engine.max_prefill_tokens_while_decoding,
                                            config.engine.max_num_seqs)
    assert engine.limits.max_prefill_tokens_while_decoding is not None  # the default config caps prefill
    assert engine.limits.kv_cache_bytes == int(config.engine.kv_cache_memory_gib * 1024**3)
    assert engine.limits.async_scheduling is False  # a CPU config


def test_engine_limits_clip_the_window_and_keep_async_scheduling_to_cuda():
    from workers.contract.model_config import ModelConfig
    from workers.core.limits import engine_limits

    cpu = ModelConfig.model_validate({"id": "m", "engine": {"max_model_len": 8192, "async_scheduling": True}})
    assert engine_limits(cpu, 2048).max_model_len == 2048
    assert engine_limits(cpu, 32768).max_model_len == 8192
    assert engine_limits(cpu, 2048).async_scheduling is False
    cuda = ModelConfig.model_validate({"id": "m", "device": "cuda", "engine": {"async_scheduling": True},
                                       "deployment": {"ray_actor_options": {"num_gpus": 1}}})
    assert engine_limits(cuda, 2048).async_scheduling is True
    assert engine_limits(cuda, 2048).max_model_len == 2048  # no configured length: the model's window


def test_direct_mode_times_both_forwards(tiny_model_dir, capsys):
    bench_engine.main(["--source", str(tiny_model_dir), "direct", "--batch", "1", "3", "--steps", "2",
                       "--repeat", "2"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("batch=")]
    assert len(lines) == 2
    for line in lines:
        sides = re.findall(r"(transformers|direct)\s+([\d.]+) ms/step", line)
        assert [name for name, _ in sides] == ["transformers", "direct"] and all(float(ms) > 0 for _, ms in sides)
        assert re.search(r"median speed-up [\d.]+x$", line)


def test_the_direct_forward_is_a_config_choice():
    from workers.contract.model_config import ModelConfig
    from workers.core.limits import engine_limits

    assert engine_limits(ModelConfig.model_validate({"id": "m"}), 2048).direct_forward is True
    off = ModelConfig.model_validate({"id": "m", "engine": {"direct_forward": False}})
    assert engine_limits(off, 2048).direct_forward is False


def test_lora_mode_compares_adapter_rows_with_the_base_model(tiny_model_dir, capsys):
    bench_engine.main(["--source", str(tiny_model_dir), "lora", "--concurrency", "4", "--num-requests", "8",
                       "--max-tokens", "4", "--prompt", "Hello there", "--adapters", "2", "--rank", "4",
                       "--repeat", "1"])
    out = capsys.readouterr().out
    rates = dict(re.findall(r"^(plain|base rows|2 adapters)\s+c=4 n=8 max_tokens=4:\s+([\d.]+) tok/s", out, re.M))
    assert set(rates) == {"plain", "base rows", "2 adapters"} and all(float(v) > 0 for v in rates.values())
    assert re.search(r"rank 4 on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj, 2 adapters / plain: [\d.]+%", out)


def test_random_adapters_are_read_back_as_peft_adapters(tiny_model, tmp_path):
    from tools.bench.lora import write_random_adapter
    from workers.contract.lora import LoraRequest
    from workers.lora.peft_files import read_peft_adapter

    path = write_random_adapter(tiny_model, tmp_path / "a", seed=0, rank=3)
    adapter = read_peft_adapter(LoraRequest.of("a", str(path)))
    assert adapter.rank == 3 and len(adapter.modules) == 7 * tiny_model.config.num_hidden_layers


def test_fused_mode_times_unfused_c_rotation_fused_and_one_call_layers(tmp_path, capsys, monkeypatch):
    """On a tiny GGUF Llama with 8-bit activations (every layer fusable): four variants a
    line, only the last running the layers in cpu_decoder.c's one call."""
    import argparse
    import types

    from tests.unit.model.test_quantized_weights import _twin_pair
    from workers.model.attention import register_paged_attention
    from workers.model.cpu_decoder import DecodeLayers
    from workers.model.gguf_packing import keep_gguf_weights_packed

    _, model = _twin_pair(tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q4_1)
    keep_gguf_weights_packed(model, tmp_path / "m.gguf", activations="int8x2")
    model.set_attn_implementation(register_paged_attention())
    calls, timed = [0], []
    one_call, timing = DecodeLayers.__call__, bench_engine.engine_decode_ms

    def counted(self, *args):
        calls[0] += 1
        return one_call(self, *args)

    def recorded(*args, **options):
        before = calls[0]
        result = timing(*args, **options)
        timed.append((options["fused"], options["one_call"], calls[0] > before))
        return result

    monkeypatch.setattr(DecodeLayers, "__call__", counted)
    monkeypatch.setattr(bench_engine, "engine_decode_ms", recorded)
    loaded = types.SimpleNamespace(model=model, tokenizer=lambda text: {"input_ids": [3, 14, 15, 9, 26]})
    bench_engine.run_fused(argparse.Namespace(batch=[3], steps=2, repeat=1), loaded)  # each run a fresh engine
    assert timed == [(False, False, False), (False, False, False), (True, False, False), (True, True, True)]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("batch=")]
    assert len(lines) == 1
    for line in lines:
        sides = re.findall(r"(unfused|c_rotation|fused|one_call)\s+([\d.]+) ms/step", line)
        assert [name for name, _ in sides] == ["unfused", "c_rotation", "fused", "one_call"]
        assert all(float(ms) > 0 for _, ms in sides)
