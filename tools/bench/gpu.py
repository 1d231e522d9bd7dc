"""GPU benchmark on random-weight Llama-shaped models: chatserve's engine vs transformers'
own continuous batching (`model.generate_batch`), same model, same load, one run.

    python -m tools.bench.gpu --shape 1b 8b        # on a GPU: 256 requests, input 512, output 256
    python -m tools.bench.gpu --tiny               # CPU smoke run of the same code (a test runs it)

Per shape it prints: output tok/s of the engine and of `generate_batch` (from each one's
first scheduled request to its last token, so neither pays for start-up or CUDA-graph
capture), the engine's decode step at batch B (default 64) and the memory-bandwidth
floor for that step: (weights read + KV read) / measured device copy bandwidth.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import json
import logging
import pstats
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from workers.contract.model_config import EngineConfig
from workers.contract.sampling_params import SamplingParams
from workers.core.limits import EngineLimits, SpeculativeLimits
from workers.engine.kv_sizing import resolve_kv_cache_bytes
from workers.engine.llm_engine import LLMEngine
from workers.model.attention import register_paged_attention
from workers.model.fused_projections import fuse_sibling_projections
from workers.model.kv_cache import KVCacheShape

# Llama-3.2-1B and Llama-3.1-8B shapes; "tiny" is for the CPU smoke run.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class Load:
    requests: int
    input_len: int
    output_len: int
    decode_batch: int


@dataclass
class ShapeReport:
    shape: str
    device: str
    dtype: str
    params_b: float
    engine_tok_s: float
    hf_tok_s: float | None
    decode_ms: float
    decode_replay_ms: float | None  # the graph replay alone: the step less its host work
    decode_eager_ms: float | None  # the same step without CUDA graphs
    floor_ms: float
    copy_gb_s: float

    def line(self) -> str:
        hf = f"{self.hf_tok_s:9.1f}" if self.hf_tok_s is not None else "      n/a"
        eager = f"{self.decode_eager_ms:.2f}" if self.decode_eager_ms is not None else "n/a"
        replay = f"{self.decode_replay_ms:.2f}" if self.decode_replay_ms is not None else "n/a"
        return (f"{self.shape:<5} {self.params_b:5.2f}B {self.dtype:<9} engine {self.engine_tok_s:9.1f} tok/s   "
                f"generate_batch {hf} tok/s   decode step {self.decode_ms:8.2f} ms (replay {replay}, eager {eager}) vs floor "
                f"{self.floor_ms:7.2f} ms ({self.floor_ms / self.decode_ms:5.1%})   copy {self.copy_gb_s:7.1f} GB/s")


def build_model(shape: str, dtype: torch.dtype, device: torch.device, overrides: dict | None = None,
                seed: int = 0) -> LlamaForCausalLM:
    """A random Llama of the shape (with `overrides` of its config fields), weights from `seed`."""
    config = LlamaConfig(**{**SHAPES[shape], **(overrides or {})}, max_position_embeddings=4096, eos_token_id=None,
                         bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    return model.eval()


def random_prompts(load: Load, vocab: int, count: int | None = None) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    n = load.requests if count is None else count
    return torch.randint(0, vocab, (n, load.input_len), generator=gen).tolist()


def make_engine(model, load: Load, device: torch.device, cuda_graphs: bool = True,
                async_scheduling: bool = True, speculative: SpeculativeLimits | None = None,
                draft_model=None) -> LLMEngine:
    """`speculative` and `draft_model`: as the worker passes them (tools/bench/gpu_spec.py)."""
    model.set_attn_implementation(register_paged_attention())
    limits = EngineLimits(block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                          max_model_len=load.input_len + load.output_len + 64,  # + the decode timing's steps
                          cuda_graph_max_batch=256 if cuda_graphs else 0,
                          async_scheduling=async_scheduling and device.type == "cuda" and speculative is None,
                          speculative=speculative)
    kv_bytes = resolve_kv_cache_bytes(EngineConfig(), device, model, limits)
    return LLMEngine(model, frozenset(), dataclasses.replace(limits, kv_cache_bytes=kv_bytes), device,
                     draft_model=draft_model)


def engine_throughput(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    """Output tok/s from the first step to the last token, all requests queued at once."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    tokens, start = 0, time.perf_counter()
    while engine.has_work():
        tokens += sum(1 for e in engine.step() if e.token_id >= 0)
    sync_device(engine.device)
    return tokens / (time.perf_counter() - start)


@dataclass
class DecodeTiming:
    step_ms: float  # engine.step(): schedule, inputs, model, sampling, events
    replay_ms: float | None  # the CUDA graph's replay alone (the device's share of the step)
    profile: str | None  # the host's hottest functions over the timed steps, when asked


def engine_decode_ms(engine: LLMEngine, prompts: list[list[int]], steps: int = 20,
                     profile: bool = False) -> DecodeTiming:
    """One decode step with len(prompts) sequences running (all prefilled first)."""
    params = SamplingParams(max_tokens=2 * steps + 4, temperature=0.0, ignore_eos=True)
    ids = {engine.add_request(p, params) for p in prompts}
    started: set[int] = set()
    while started != ids:
        started |= {e.request_id for e in engine.step()}
    engine.step()
    sync_device(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync_device(engine.device)
    elapsed = (time.perf_counter() - start) / steps * 1000
    replay_ms = _replay_ms(engine, len(prompts), steps)
    report = _profile_steps(engine, steps) if profile else None
    for request_id in ids:
        engine.abort_request(request_id)
    return DecodeTiming(elapsed, replay_ms, report)


def _replay_ms(engine: LLMEngine, batch: int, reps: int) -> float | None:
    """Replays of the graph the last step ran (same inputs: it rewrites the same slots)."""
    graphs = engine.decode_graphs
    if graphs is None or not graphs.fits(batch):
        return None
    graph = graphs.graphs[next(s for s in graphs.sizes if s >= batch), False]  # (size, with LoRA)
    sync_device(engine.device)
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    sync_device(engine.device)
    return (time.perf_counter() - start) / reps * 1000


def _profile_steps(engine: LLMEngine, steps: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    sync_device(engine.device)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    return text.getvalue()


def hf_throughput(model, prompts: list[list[int]], output_len: int, cb_config: ContinuousBatchingConfig) -> float:
    """transformers' continuous batching on the same model; timed from its first scheduled
    request to its last token (its warm-up and graph capture excluded)."""
    model.set_attn_implementation("sdpa")
    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None)
    results = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config,
                                   record_timestamps=True)
    outs = list(results.values())
    failed = [o.error for o in outs if o.error is not None]
    if failed or len(outs) != len(prompts):
        raise RuntimeError(f"generate_batch: {len(outs)} results for {len(prompts)} prompts, errors {failed[:3]}")
    tokens = sum(len(o.generated_tokens) for o in outs)
    start = min(o.lifespan[0] for o in outs)
    end = max(o.lifespan[1] for o in outs)
    return tokens / (end - start)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (counting read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync_device(device)
    reps = 10
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync_device(device)
    return 2 * nbytes * reps / (time.perf_counter() - start)


def bytes_read_per_decode_step(model, load: Load) -> int:
    """Every weight once (the input embedding only for its looked-up rows, unless it is
    tied to the LM head), plus the K/V of every running sequence's context."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        emb = model.get_input_embeddings().weight
        weights -= emb.numel() * emb.element_size()
    kv = KVCacheShape.from_model_config(model.config, model.dtype).bytes_per_token
    return weights + load.decode_batch * (load.input_len + 10) * kv


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA): timings end here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_shape(shape: str, load: Load, device: torch.device, dtype: torch.dtype, skip_hf: bool,
              cuda_graphs: bool, profile: bool = False, async_scheduling: bool = True,
              fuse: bool = True) -> ShapeReport:
    model = build_model(shape, dtype, device)
    if fuse:  # as the worker loads a model; generate_batch then runs the fused model too
        fuse_sibling_projections(model)
    vocab = model.config.vocab_size
    params_b = sum(p.numel() for p in model.parameters()) / 1e9
    engine = make_engine(model, load, device, cuda_graphs, async_scheduling)
    engine_throughput(engine, random_prompts(load, vocab, 2), 4)  # warm-up
    engine_tok_s = engine_throughput(engine, random_prompts(load, vocab), load.output_len)
    decode = engine_decode_ms(engine, random_prompts(load, vocab, load.decode_batch), profile=profile)
    if decode.profile:
        print(decode.profile, flush=True)
    decode_eager_ms = None
    if device.type == "cuda" and cuda_graphs:
        engine.runner.decode_graphs = None  # same engine and cache, eager steps
        decode_eager_ms = engine_decode_ms(engine, random_prompts(load, vocab, load.decode_batch)).step_ms
    del engine
    free_device_memory(device)
    bandwidth = copy_bandwidth(device, 1 << (30 if device.type == "cuda" else 26))
    floor_ms = bytes_read_per_decode_step(model, load) / bandwidth * 1000
    # On CUDA: its CUDA graphs on (the terms). On CPU its default cache takes a share
    # of host RAM (seconds of page zeroing): size it.
    if device.type == "cuda":
        cb_config = ContinuousBatchingConfig(use_cuda_graph=True)
    else:
        cb_config = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256)
    hf_tok_s = None if skip_hf else hf_throughput(model, random_prompts(load, vocab), load.output_len, cb_config)
    report = ShapeReport(shape, device.type, str(dtype).removeprefix("torch."), params_b, engine_tok_s, hf_tok_s,
                         decode.step_ms, decode.replay_ms, decode_eager_ms, floor_ms, bandwidth / 1e9)
    del model
    free_device_memory(device)
    return report


def free_device_memory(device: torch.device) -> None:
    """Drop what the last model or engine left: Python's garbage, then CUDA's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_device(parser: argparse.ArgumentParser, tiny: bool) -> tuple[torch.device, torch.dtype]:
    """The CPU in float32 for a smoke run; else the CUDA device in bfloat16 (a usage error
    without one)."""
    if tiny:
        return torch.device("cpu"), torch.float32
    if not torch.cuda.is_available():
        parser.error("no CUDA device: use --tiny for the CPU smoke run")
    return torch.device("cuda"), torch.bfloat16


def write_reports(path: str | None, load: Load, key: str, reports: list) -> None:
    """The load and the reports (dataclasses) as JSON at `path`, when one is given."""
    if path:
        with open(path, "w") as f:
            json.dump({"load": dataclasses.asdict(load), key: [dataclasses.asdict(r) for r in reports]}, f, indent=2)


def main(argv: list[str] | None = None) -> list[ShapeReport]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["1b", "8b"])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shape, small load, float32")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true", help="engine only")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="engine decode steps eager")
    parser.add_argument("--profile", action="store_true", help="print the host's hottest functions in decode steps")
    parser.add_argument("--no-async", action="store_true", help="engine steps one at a time (no async scheduling)")
    parser.add_argument("--no-fuse", action="store_true", help="separate q/k/v and gate/up projections")
    parser.add_argument("--json", default=None, help="also write the reports here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the graph-capture line
    device, dtype = bench_device(parser, args.tiny)
    shapes = ["tiny"] if args.tiny else args.shape
    load = (Load(requests=8, input_len=16, output_len=8, decode_batch=4) if args.tiny
            else Load(args.requests, args.input_len, args.output_len, args.decode_batch))
    print(f"load: {load.requests} requests, input {load.input_len}, output {load.output_len}, ignore_eos; "
          f"decode step at batch {load.decode_batch}", flush=True)
    reports = []
    for shape in shapes:
        report = run_shape(shape, load, device, dtype, args.skip_hf, not args.no_cuda_graphs, args.profile,
                           not args.no_async, not args.no_fuse)
        print(report.line(), flush=True)
        reports.append(report)
    write_reports(args.json, load, "shapes", reports)
    return reports


if __name__ == "__main__":
    main()
