"""Offline engine benchmarks (no Ray, no HTTP): the ceilings the serving path is compared with.

    python -m tools.bench.engine decode --batch 1 16 32       # decode step: engine vs raw HF forward
    python -m tools.bench.engine decode --batch 1 16 --guided # also: every row under a JSON schema
    python -m tools.bench.engine packing   # raw decode step: plain vs oneDNN-packed weights, alternating
    python -m tools.bench.engine fusion    # raw decode step: separate vs fused q/k/v and gate/up
    python -m tools.bench.engine direct    # engine decode step: transformers' forward vs the direct forward
    python -m tools.bench.engine attention --context 128 1024  # decode step: SDPA over a gather vs the C kernel
    python -m tools.bench.engine offline --concurrency 1 16 32 64 --max-tokens 64
    python -m tools.bench.engine worker --concurrency 1 32  # the worker's request path, no Ray
    python -m tools.bench.engine prefix --prefix-tokens 1000  # TTFT: first vs second request sharing a prefix
    python -m tools.bench.engine fairness --streams 16 --long-prompt 2000 --budget 256 2048
    python -m tools.bench.engine lora --concurrency 32 --adapters 4 --rank 16  # rows over 4 adapters vs base

`decode --guided` runs the same batch a second time with each request constrained by
BENCH_SCHEMA (an array of at least 1000 objects, so no row can finish early) and reports
the time spent building the grammar mask and applying it to the logits.

`offline` runs the load `tools.bench.load` puts on the server (same templated prompt,
temperature 0.8, ignore_eos, closed loop at C requests, max(8, 2C) requests per level),
straight into `LLMEngine.step()`, and reports the same figures: output tok/s, TTFT and
TPOT (median, p99). TTFT here is from `add_request` to the first token's step. Its engine
takes the limits of the first model in `--config` (default configs/default.yaml: the
Serve path's own step budget, prefill cap, sequence cap and KV pool), so both sides
schedule alike.

`worker` runs the same load through the worker's own request path in this process: the
engine on its thread (`AsyncEngine`), chat messages templated, tokenized and detokenized
by `RequestProcessor` on an asyncio loop, with `--config`'s limits; only Ray and HTTP are missing. Between
`offline` and the Serve path it tells the worker's threads apart from Serve's hops.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from tools.bench import lora as lora_bench
from workers.contract.model_config import ModelConfig
from workers.contract.sampling_params import GuidedDecoding, SamplingParams
from workers.core.limits import EngineLimits
from workers.engine.kv_sizing import sized_engine_limits
from workers.engine.llm_engine import LLMEngine
from workers.lora.manager import LORA_TARGETS
from workers.model import cpu_linear
from workers.model.attention import register_paged_attention
from workers.model.cpu_attention import cpu_decode_attention
from workers.model.fused_projections import fuse_sibling_projections
from workers.model.loader import LoadedModel, load_model
from workers.serving.host_memory import keep_freed_memory

PROMPT = "Write a long story about a robot who learns to paint."
BENCH_PROMPT = "Write a long story about a robot who learns to paint. Use vivid detail."  # tools.bench.load's
KV_BYTES = 1024**3
SERVE_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "default.yaml")  # the CPU default
BENCH_SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "tags"],
    },
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def new_engine(model, tokenizer=None, **limits) -> LLMEngine:
    return LLMEngine(model, frozenset(), EngineLimits(kv_cache_bytes=KV_BYTES, **limits), torch.device("cpu"),
                     tokenizer=tokenizer)


def served_model_config(path: str) -> ModelConfig:
    """The first model of a `serve run` config: the engine settings the Serve path runs with."""
    with open(path) as f:
        serve_config = yaml.safe_load(f)
    return ModelConfig.model_validate(serve_config["applications"][0]["args"]["models"][0])


def configured_engine(model, config: ModelConfig, tokenizer=None) -> LLMEngine:
    """An engine with the limits and CPU KV pool `config` gives the worker (no EOS: the loads
    here ignore it)."""
    cpu = torch.device("cpu")
    return LLMEngine(model, frozenset(), sized_engine_limits(config, model, cpu), cpu, tokenizer=tokenizer)


# --- decode: engine step vs raw HF forward -------------------------------------------------


@torch.inference_mode()
def raw_decode_ms(model, prompt_ids: list[int], batch: int, steps: int) -> float:
    out = model(torch.tensor([prompt_ids] * batch), use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - start) / steps * 1000


def engine_decode_ms(model, prompt_ids: list[int], batch: int, steps: int, tokenizer=None,
                     cpu_decode: bool | None = None, fused: bool = True, one_call: bool = True,
                     **limits) -> tuple[float, float]:
    """(ms per decode step, ms of it spent on the grammar mask); guided when `tokenizer` is
    given; `cpu_decode`: decode attention by the C kernel or not (None: the engine's
    choice); `fused`: False runs a quantized model's layers unfused; `one_call`: False runs
    fused layers one call per operation (not all in cpu_decoder.c's one call); `limits`:
    EngineLimits fields."""
    engine = new_engine(model, tokenizer, **limits)
    if cpu_decode is not None:
        engine.runner.cpu_decode = cpu_decode
    direct = engine.runner.direct
    if direct is not None and not (fused and one_call):
        direct.decode_layers = None
    if not fused and direct is not None:
        direct.layers = [dataclasses.replace(layer, fused=None) for layer in direct.layers]
        direct.fused_head = None
    guided = GuidedDecoding("json_schema", json.dumps(BENCH_SCHEMA)) if tokenizer is not None else None
    for _ in range(batch):
        engine.add_request(prompt_ids, SamplingParams(max_tokens=steps + 8, temperature=0.8, ignore_eos=True,
                                                      guided=guided))
    mask_s = _time_masks(engine)
    while len(engine.step()) < batch:  # prefill everyone (long prompts take several steps)
        pass
    engine.step()
    mask_s[0] = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed_s = time.perf_counter() - start
    assert engine.num_active == batch, "a request finished early: the timing would mix batch sizes"
    # An engine holds reference cycles, so only the cycle collector frees it and its KV
    # pool: without this, callers that time many engines in turn pile up gigabytes.
    del engine
    gc.collect()
    return elapsed_s / steps * 1000, mask_s[0] / steps * 1000


def _time_masks(engine: LLMEngine) -> list[float]:
    """Accumulate the seconds spent building the grammar mask and applying it to the logits."""
    total = [0.0]

    def timed(fn):
        def run(*args):
            start = time.perf_counter()
            out = fn(*args)
            total[0] += time.perf_counter() - start
            if out is not None and hasattr(out, "apply"):
                out.apply = timed(out.apply)
            return out

        return run

    if engine.guided is not None:
        engine.guided.mask = timed(engine.guided.mask)
    return total


def run_decode(args, loaded) -> None:
    model, prompt_ids = loaded.model, loaded.tokenizer(PROMPT)["input_ids"]
    tokenizer = loaded.tokenizer if args.guided else None
    for batch in args.batch:
        runs = [_one_decode_run(model, prompt_ids, batch, args.steps, tokenizer) for _ in range(args.repeat)]
        raw, eng = min(r[0] for r in runs), min(r[1] for r in runs)
        line = (f"batch={batch:<3} raw HF {raw:7.1f} ms/step ({batch * 1000 / raw:6.1f} tok/s)   "
                f"engine {eng:7.1f} ms/step ({batch * 1000 / eng:6.1f} tok/s)")
        if args.guided:
            guided, mask = min(r[2] for r in runs), min(r[3] for r in runs)
            line += f"   guided {guided:7.1f} ms/step ({batch * 1000 / guided:6.1f} tok/s, mask {mask:5.2f} ms)"
        print(line, flush=True)


def _one_decode_run(model, prompt_ids: list[int], batch: int, steps: int, tokenizer) -> tuple[float, float, float, float]:
    """(raw HF, engine, guided engine, of which the mask) ms per step; guided only with a tokenizer."""
    model.set_attn_implementation("sdpa")
    raw = raw_decode_ms(model, prompt_ids, batch, steps)
    model.set_attn_implementation(register_paged_attention())
    eng, _ = engine_decode_ms(model, prompt_ids, batch, steps)
    guided, mask = engine_decode_ms(model, prompt_ids, batch, steps, tokenizer) if tokenizer else (0.0, 0.0)
    return raw, eng, guided, mask


def run_packing(args, loaded) -> None:
    """Raw decode step of the plain model against a packed copy, alternating in one process
    (the fairest A/B on a noisy machine), and what the load-time probe would decide."""
    model = loaded.model
    model.set_attn_implementation("sdpa")
    packs_float32 = cpu_linear.float32_packing_pays(model)
    packed = copy.deepcopy(model)
    print(f"packed {cpu_linear.pack_linear_layers(packed, float32=True)} layers; "
          f"the probe {'would' if packs_float32 else 'would not'} pack float32 on this CPU", flush=True)
    alternate_decode_steps(args, loaded.tokenizer(PROMPT)["input_ids"], {"plain": model, "packed": packed})


def run_fusion(args, loaded) -> None:
    """Raw decode step with separate q/k/v and gate/up projections against fused ones
    (workers/model/fused_projections.py), both packed as the loader would, alternating."""
    model = loaded.model
    model.set_attn_implementation("sdpa")
    fused = copy.deepcopy(model)
    groups = fuse_sibling_projections(fused)
    if not args.no_pack:
        packs_float32 = cpu_linear.float32_packing_pays(fused)  # the loader's decision, for both sides
        cpu_linear.pack_linear_layers(model, float32=packs_float32)
        cpu_linear.pack_linear_layers(fused, float32=packs_float32)
    print(f"fused {groups} groups; packed: {not args.no_pack}", flush=True)
    alternate_decode_steps(args, loaded.tokenizer(PROMPT)["input_ids"], {"separate": model, "fused": fused})


def run_direct(args, loaded) -> None:
    """The engine's decode step through transformers' forward against the direct forward
    (workers/model/direct_forward.py), alternating in one process."""
    alternate_engine_steps(args, loaded.model, loaded.tokenizer(PROMPT)["input_ids"],
                           {"transformers": {"direct_forward": False}, "direct": {"direct_forward": True}})


def run_attention(args, loaded) -> None:
    """The engine's decode step with decode attention by SDPA over a gather against the C
    kernel (workers/model/cpu_attention.c), alternating in one process, at each context."""
    base = loaded.tokenizer(PROMPT)["input_ids"]
    for context in args.context:
        print(f"context {context} tokens", flush=True)
        alternate_engine_steps(args, loaded.model, (base * (context // len(base) + 1))[:context],
                               {"sdpa": {"cpu_decode": False}, "cpu_kernel": {"cpu_decode": True}})


def run_fused(args, loaded) -> None:
    """A quantized model's decode step: layers unfused with torch's rotation and cache write,
    then with the C rotation and cache write, then fused too (direct_forward.py), then all
    fused layers in one C call (cpu_decoder.c), alternating in one process."""
    kernel = cpu_decode_attention()
    if kernel is None:
        raise SystemExit("no C compiler: the C rotation and the fused products need one")
    rotate = kernel.rotate_and_cache

    def torch_rotation(*args) -> bool:
        return False  # the direct forward then rotates with torch's operators and index_copy_

    def variant(use_c_rotation: bool, fused: bool, one_call: bool = False) -> Callable[[int], float]:
        def run(batch: int) -> float:
            kernel.rotate_and_cache = rotate if use_c_rotation else torch_rotation
            try:
                return engine_decode_ms(loaded.model, prompt_ids, batch, args.steps, fused=fused,
                                        one_call=one_call)[0]
            finally:
                kernel.rotate_and_cache = rotate
        return run

    prompt_ids = loaded.tokenizer(PROMPT)["input_ids"]
    variants = {"unfused": variant(False, False), "c_rotation": variant(True, False), "fused": variant(True, True),
                "one_call": variant(True, True, one_call=True)}
    for batch in args.batch:
        runs: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeat):
            for name, run in variants.items():
                runs[name].append(run(batch))
        print(alternation_line(batch, runs), flush=True)


def alternate_engine_steps(args, model, prompt_ids: list[int], variants: dict[str, dict]) -> None:
    """Per batch size: `args.repeat` rounds, each timing an engine of every variant
    (engine_decode_ms keywords) once in turn."""
    for batch in args.batch:
        runs: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeat):
            for name, options in variants.items():
                runs[name].append(engine_decode_ms(model, prompt_ids, batch, args.steps, **options)[0])
        print(alternation_line(batch, runs), flush=True)


@torch.inference_mode()
def alternate_decode_steps(args, prompt_ids: list[int], models: dict[str, torch.nn.Module]) -> None:
    """Per batch size: `args.repeat` rounds, each timing every model once in turn."""
    for batch in args.batch:
        runs: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.repeat):
            for name, model in models.items():
                runs[name].append(raw_decode_ms(model, prompt_ids, batch, args.steps))
        print(alternation_line(batch, runs), flush=True)


def alternation_line(batch: int, runs: dict[str, list[float]]) -> str:
    """The variants' median (and fastest) ms per step side by side, and the speed-up of the
    last over the first."""
    (first, *_, last) = runs
    med = {name: statistics.median(times) for name, times in runs.items()}
    sides = "   ".join(f"{name} {med[name]:7.1f} ms/step (min {min(runs[name]):7.1f})" for name in runs)
    return f"batch={batch:<3} {sides}   median speed-up {med[first] / med[last]:.2f}x"


# --- offline: the serving load, straight into the engine ----------------------------------


@dataclass
class OfflineReport:
    concurrency: int
    requests: int
    wall_s: float
    output_tok_s: float
    ttft_median_ms: float
    ttft_p99_ms: float
    tpot_median_ms: float
    tpot_p99_ms: float

    @classmethod
    def of(cls, concurrency: int, requests: int, wall_s: float, tokens: int, ttfts_ms: list[float],
           tpots_ms: list[float]) -> "OfflineReport":
        return cls(concurrency, requests, wall_s, tokens / wall_s, statistics.median(ttfts_ms),
                   percentile(ttfts_ms, 99), statistics.median(tpots_ms) if tpots_ms else float("nan"),
                   percentile(tpots_ms, 99))

    def line(self, label: str = "engine") -> str:
        return (f"{label} c={self.concurrency:<3} n={self.requests:<4} tok/s={self.output_tok_s:8.1f}  "
                f"TTFT med={self.ttft_median_ms:8.1f} ms p99={self.ttft_p99_ms:8.1f} ms  "
                f"TPOT med={self.tpot_median_ms:7.1f} ms p99={self.tpot_p99_ms:7.1f} ms")


def offline_level(engine: LLMEngine, prompt_ids: list[int], concurrency: int, num_requests: int,
                  max_tokens: int, loras: tuple[str | None, ...] = (None,), staggered: bool = False) -> OfflineReport:
    """`loras`: the adapter keys requests take in turn (None: the base model). `staggered`:
    the first `concurrency` requests come in one a step rather than all at once, so they
    end, and their successors come, spread over the steps as they do over HTTP (all at
    once, they run in lockstep: one prefill step for the whole batch, then only decodes)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, ignore_eos=True)
    added: dict[int, float] = {}
    times: dict[int, list[float]] = {}

    def add() -> None:
        added[engine.add_request(prompt_ids, params, lora=loras[len(added) % len(loras)])] = time.perf_counter()

    start = time.perf_counter()
    first_wave = min(concurrency, num_requests)
    for _ in range(1 if staggered else first_wave):
        add()
    while engine.has_work():
        for event in engine.step():
            times.setdefault(event.request_id, []).append(event.time)
            if event.request_finished and len(added) < num_requests:  # closed loop, as the HTTP bench
                add()
        if len(added) < first_wave:
            add()
    wall = time.perf_counter() - start
    ttfts = [(times[r][0] - added[r]) * 1000 for r in added]
    tpots = [(t[-1] - t[0]) / (len(t) - 1) * 1000 for t in times.values() if len(t) > 1]
    return OfflineReport.of(concurrency, num_requests, wall, sum(len(t) for t in times.values()), ttfts, tpots)


def run_offline(args, loaded) -> None:
    messages = [{"role": "user", "content": args.prompt}]
    prompt_ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
    engine = configured_engine(loaded.model, served_model_config(args.config))
    offline_level(engine, prompt_ids, 1, 1, 4)  # warm-up
    reports = []
    for concurrency in args.concurrency:
        n = args.num_requests or max(8, 2 * concurrency)
        report = offline_level(engine, prompt_ids, concurrency, n, args.max_tokens)
        print(report.line(), flush=True)
        reports.append(report)
    write_reports(args.json, reports, max_tokens=args.max_tokens, prompt_tokens=len(prompt_ids))


def write_reports(path: str | None, reports: list, **facts) -> None:
    """The levels' reports as tools.bench.load writes them (tools.bench.compare reads both)."""
    if path:
        with open(path, "w") as f:
            json.dump({**facts, "levels": [dataclasses.asdict(r) for r in reports]}, f, indent=2)


# --- lora: the serving load spread over adapters vs the base model ------------------------


def run_lora(args, loaded) -> None:
    """tools/bench/lora.py says what the three engines are."""
    messages = [{"role": "user", "content": args.prompt}]
    prompt_ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
    config = served_model_config(args.config)
    plain = configured_engine(loaded.model, config)
    # A second copy of the model for the LoRA layers (they wrap its projections in place).
    lora_model = load_model(args.source, dtype=args.dtype, attn_implementation=register_paged_attention(),
                            pack_cpu_weights=not args.no_pack, fuse_projections=not args.no_fuse).model
    engine = configured_engine(lora_model, lora_bench.with_lora(config, args.adapters, args.rank))
    # Adapters are written from the plain copy: its module names are the PEFT names.
    keys = lora_bench.register_adapters(engine, loaded.model, args.adapters, args.rank, tuple(args.targets))
    for warm in (plain, engine):
        offline_level(warm, prompt_ids, 1, 1, 4)
    c, n, m = args.concurrency[0], args.num_requests or max(8, 2 * args.concurrency[0]), args.max_tokens
    results = lora_bench.compare({
        "plain": lambda: offline_level(plain, prompt_ids, c, n, m).output_tok_s,
        "base rows": lambda: offline_level(engine, prompt_ids, c, n, m).output_tok_s,
        f"{args.adapters} adapters": lambda: offline_level(engine, prompt_ids, c, n, m, tuple(keys)).output_tok_s,
    }, args.repeat)
    lines = [f"{name:<11} c={c} n={n} max_tokens={m}: {best:7.1f} tok/s (median {median:7.1f})"
             for name, (best, median) in results.items()]
    plain_best = results["plain"][0]
    ratio = results[f"{args.adapters} adapters"][0] / plain_best
    print("\n".join(lines) + f"\nrank {args.rank} on {','.join(args.targets)}, {args.adapters} adapters / plain: "
          f"{ratio:.1%} "
          f"(target >= 80%); base rows / plain: {results['base rows'][0] / plain_best:.1%}", flush=True)


# --- deterministic: the batch-invariant mode's cost -----------------------------------------


def run_deterministic(args, loaded) -> None:
    """The offline load with `engine.deterministic` off and on (a second copy of the model,
    loaded again: the mode wraps its layers in place, and packed weights cannot be deep-
    copied), alternating rounds; the median of each shown."""
    messages = [{"role": "user", "content": args.prompt}]
    prompt_ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
    config = served_model_config(args.config)
    engines = {}
    for flag, model in ((False, loaded.model), (True, load_as_asked(args).model)):
        engine_config = config.engine.model_copy(update={"deterministic": flag})
        engines[flag] = configured_engine(model, config.model_copy(update={"engine": engine_config}))
        offline_level(engines[flag], prompt_ids, 1, 1, 4)  # warm-up
    for concurrency in args.concurrency:
        n = args.num_requests or max(8, 2 * concurrency)
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeat):
            for flag, engine in engines.items():
                rates[flag].append(offline_level(engine, prompt_ids, concurrency, n, args.max_tokens).output_tok_s)
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"c={concurrency:<3} n={n} max_tokens={args.max_tokens}: off {off:7.1f} tok/s, deterministic "
              f"{on:7.1f} tok/s ({on / off:.2f}x; rounds off {[round(r, 1) for r in rates[False]]}, "
              f"on {[round(r, 1) for r in rates[True]]})", flush=True)
    for length in args.long_prompt:  # every prompt span by the decode kernel: what a long prefill pays
        ttfts: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.repeat):
            prompt = long_text_ids(loaded.tokenizer, length, seed=round_)
            for flag, engine in engines.items():
                ttfts[flag].append(ttft_ms(engine, prompt))
        off, on = statistics.median(ttfts[False]), statistics.median(ttfts[True])
        print(f"TTFT of a {length}-token prompt alone: off {off:7.0f} ms, deterministic {on:7.0f} ms "
              f"({on / off:.2f}x)", flush=True)


# --- worker: the worker's request path in this process (no Ray) -----------------------------


async def worker_level(processor, prompt: str, concurrency: int, num_requests: int, max_tokens: int) -> OfflineReport:
    from workers.contract.requests import GenerateRequest

    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, ignore_eos=True)
    ttfts: list[float] = []
    tpots: list[float] = []
    tokens = 0
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        nonlocal tokens
        request = GenerateRequest(request_id=f"bench-{i}", params=params, max_tokens=max_tokens,
                                  messages=[{"role": "user", "content": prompt}])
        async with slots:
            start = time.perf_counter()
            arrivals = []
            async for batch in processor.stream(request):  # each wake-up's chunks, as the worker sends them
                now = time.perf_counter()
                for chunk in batch:
                    arrivals.append(now)
                    tokens += len(chunk.token_ids)
        ttfts.append((arrivals[0] - start) * 1000)
        if len(arrivals) > 1:
            tpots.append((arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(num_requests)))
    return OfflineReport.of(concurrency, num_requests, time.perf_counter() - start, tokens, ttfts, tpots)


async def start_worker(source: str, threads: int | None = None, dtype: str = "auto", pack: bool = True,
                       fuse: bool = True, config_path: str = SERVE_CONFIG,
                       on_build: Callable[[LLMEngine], None] | None = None):
    """(AsyncEngine, RequestProcessor) as the deployment builds them: the model loaded on
    the engine's own thread, the engine limited as `config_path`'s first model. `on_build`
    sees the engine before it starts. The caller stops the engine."""
    from workers.serving.async_engine import AsyncEngine
    from workers.serving.request_processor import RequestProcessor

    tokenizers = []

    def build() -> LLMEngine:
        if threads:
            torch.set_num_threads(threads)
        loaded = load_model(source, dtype=dtype, attn_implementation=register_paged_attention(),
                            pack_cpu_weights=pack, fuse_projections=fuse)
        tokenizers.append(loaded.tokenizer)
        engine = configured_engine(loaded.model, served_model_config(config_path), loaded.tokenizer)
        if on_build is not None:
            on_build(engine)
        return engine

    engine = AsyncEngine.start_on_own_thread(build, asyncio.get_running_loop())
    return engine, RequestProcessor(engine, tokenizers[0])


async def run_worker(args) -> None:
    engine, processor = await start_worker(args.source, args.threads, args.dtype, not args.no_pack, not args.no_fuse,
                                           args.config)
    try:
        await worker_level(processor, args.prompt, 1, 2, 4)  # warm-up
        reports = []
        for concurrency in args.concurrency:
            n = args.num_requests or max(8, 2 * concurrency)
            report = await worker_level(processor, args.prompt, concurrency, n, args.max_tokens)
            print(report.line("worker"), flush=True)
            reports.append(report)
        write_reports(args.json, reports, max_tokens=args.max_tokens)
    finally:
        engine.stop()


# --- prefix: TTFT of a request sharing a long prefix with an earlier one -------------------


def ttft_ms(engine: LLMEngine, prompt_ids: list[int]) -> float:
    """Time from add_request to the first token, alone in the engine; runs it to the end."""
    start = time.perf_counter()
    engine.add_request(prompt_ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    first = None
    while engine.has_work():
        for event in engine.step():
            first = first or event.time
    return (first - start) * 1000


def long_text_ids(tokenizer, num_tokens: int, seed: int) -> list[int]:
    words = [f"item{(seed * 7919 + i * 104729) % 100000}" for i in range(num_tokens)]
    return tokenizer(" ".join(words))["input_ids"][:num_tokens]


def run_prefix(args, loaded) -> None:
    tok = loaded.tokenizer
    shared = long_text_ids(tok, args.prefix_tokens, seed=1)
    first = shared + tok(" Question: what is the first item?")["input_ids"]
    second = shared + tok(" Question: how many items are there?")["input_ids"]
    for enabled in (True, False):
        engine = new_engine(loaded.model, enable_prefix_caching=enabled, max_num_batched_tokens=args.budget)
        ttft_ms(engine, long_text_ids(tok, args.prefix_tokens, seed=2))  # warm-up, unrelated prefix
        a, b = ttft_ms(engine, first), ttft_ms(engine, second)
        print(f"prefix cache {'on ' if enabled else 'off'}: {args.prefix_tokens}-token shared prefix, "
              f"prompts {len(first)} / {len(second)} tokens: TTFT first {a:8.1f} ms, second {b:8.1f} ms "
              f"({b / a:6.1%} of first; target < 30% with the cache on)", flush=True)


# --- fairness: decode streams while a long prompt arrives ----------------------------------


def stream_gaps(engine: LLMEngine, streams: set[int], steps: int, last: dict[int, float]) -> list[float]:
    """Inter-token gaps (ms) of `streams` over `steps` engine steps."""
    gaps = []
    for _ in range(steps):
        for event in engine.step():
            if event.request_id in streams:
                gaps.append((event.time - last[event.request_id]) * 1000)
                last[event.request_id] = event.time
    return gaps


def fairness_level(loaded, budget: int, num_streams: int, long_tokens: int, steps: int,
                   prefill_cap: int | None = None) -> tuple[float, float, float]:
    engine = new_engine(loaded.model, max_num_batched_tokens=budget, max_model_len=long_tokens + 64,
                        max_prefill_tokens_while_decoding=prefill_cap)
    prompt = loaded.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=4 * steps + 16, temperature=0.8, ignore_eos=True)
    streams = {engine.add_request(prompt, params) for _ in range(num_streams)}
    last: dict[int, float] = {}
    while len(last) < num_streams:  # everyone prefilled and decoding
        last.update({e.request_id: e.time for e in engine.step() if e.request_id in streams})
    quiet = stream_gaps(engine, streams, steps, last)
    long_prompt = long_text_ids(loaded.tokenizer, long_tokens, seed=3)
    engine.add_request(long_prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    busy = stream_gaps(engine, streams, steps, last)
    return percentile(quiet, 99), percentile(busy, 99), max(busy)


def run_fairness(args, loaded) -> None:
    for budget in args.budget:
        chunk = max(1, budget - args.streams)  # the decodes go first
        if args.prefill_cap is not None:
            chunk = min(chunk, args.prefill_cap)
        chunks = -(-args.long_prompt // chunk)
        steps = max(args.steps, 2 * chunks)
        quiet, busy, worst = fairness_level(loaded, budget, args.streams, args.long_prompt, steps, args.prefill_cap)
        cap = f", prefill cap {args.prefill_cap}" if args.prefill_cap is not None else ""
        print(f"budget {budget:5d} tokens/step{cap}, {args.streams} streams, {steps} steps each: inter-token p99 "
              f"{quiet:7.1f} ms without, {busy:7.1f} ms with a {args.long_prompt}-token prompt arriving "
              f"(max {worst:7.1f} ms; its prefill in {chunks} chunk(s))", flush=True)


def load_as_asked(args) -> LoadedModel:
    """The model as the command line asks (packed and fused unless a variant is measured)."""
    ab_test = args.command in ("packing", "fusion")  # these build their own variants
    loaded = load_model(args.source, dtype=args.dtype, pack_cpu_weights=not (args.no_pack or ab_test),
                        fuse_projections=not (args.no_fuse or args.command == "fusion"),
                        quantization=args.quantization, quantized_activations=args.quantized_activations)
    if args.command != "decode":
        loaded.model.set_attn_implementation(register_paged_attention())
    return loaded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="as the model config's dtype (auto: workers/model/loader.py picks)")
    parser.add_argument("--no-pack", action="store_true", help="CPU: plain torch linear layers, as transformers "
                        "runs them (default: oneDNN-packed weights where the worker would pack them)")
    parser.add_argument("--no-fuse", action="store_true", help="separate q/k/v and gate/up projections, as "
                        "transformers runs them (default: fused, as the worker loads them)")
    parser.add_argument("--quantization", choices=("auto", "none"), default="auto",
                        help="as the model config's quantization (auto: a GGUF file's blocks kept quantized)")
    parser.add_argument("--quantized-activations", choices=("int8x2", "int8", "float32"), default="int8x2",
                        help="as the model config's quantized_activations")
    sub = parser.add_subparsers(dest="command", required=True)
    decode = sub.add_parser("decode", help="decode step: engine vs raw HF forward (the raw model-forward rate)")
    decode.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32])
    decode.add_argument("--steps", type=int, default=20)
    decode.add_argument("--guided", action="store_true", help="also time every row under a JSON schema")
    decode.add_argument("--repeat", type=int, default=1, help="runs per setting, interleaved; the fastest is shown "
                        "(on a shared machine the minimum is the least disturbed)")
    packing = sub.add_parser("packing", help="raw decode step, plain vs oneDNN-packed weights, alternating")
    packing.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32, 64])
    packing.add_argument("--steps", type=int, default=10)
    packing.add_argument("--repeat", type=int, default=5)
    fusion = sub.add_parser("fusion", help="raw decode step, separate vs fused q/k/v and gate/up, alternating")
    fusion.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32, 64])
    fusion.add_argument("--steps", type=int, default=10)
    fusion.add_argument("--repeat", type=int, default=5)
    direct = sub.add_parser("direct", help="engine decode step, transformers' forward vs the direct forward, "
                            "alternating")
    direct.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32, 64])
    direct.add_argument("--steps", type=int, default=10)
    direct.add_argument("--repeat", type=int, default=5)
    fused = sub.add_parser("fused", help="a quantized model's decode step: unfused layers, the C rotation, fused "
                           "layers, all in one call, alternating")
    fused.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    fused.add_argument("--steps", type=int, default=20)
    fused.add_argument("--repeat", type=int, default=5)
    attention = sub.add_parser("attention", help="engine decode step, decode attention by SDPA over a gather vs "
                               "the C kernel, alternating")
    attention.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    attention.add_argument("--context", type=int, nargs="+", default=[128, 1024], help="prompt tokens")
    attention.add_argument("--steps", type=int, default=10)
    attention.add_argument("--repeat", type=int, default=5)
    serving_load = argparse.ArgumentParser(add_help=False)  # tools.bench.load's load, for offline and worker
    serving_load.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32, 64])
    serving_load.add_argument("--num-requests", type=int, default=None, help="per level; default 2 x concurrency, >= 8")
    serving_load.add_argument("--max-tokens", type=int, default=64)
    serving_load.add_argument("--prompt", default=BENCH_PROMPT)
    serving_load.add_argument("--config", default=SERVE_CONFIG, help="serve config whose first model's engine "
                              "limits the engine takes (default: configs/default.yaml)")
    serving_load.add_argument("--json", default=None, help="also write the reports here")
    sub.add_parser("offline", parents=[serving_load], help="the HTTP bench's load straight into the engine")
    sub.add_parser("worker", parents=[serving_load], help="the same load through the worker's request path (no Ray)")
    determinism = sub.add_parser("deterministic", parents=[serving_load], help="the offline load with "
                                 "engine.deterministic off and on, alternating")
    determinism.add_argument("--repeat", type=int, default=3, help="rounds; the median of each is shown")
    determinism.add_argument("--long-prompt", type=int, nargs="*", default=[1000, 2000],
                             help="also the TTFT of prompts this long (a new text each round: no cache hit)")
    prefix = sub.add_parser("prefix", help="TTFT of a request sharing a long prefix with an earlier one")
    prefix.add_argument("--prefix-tokens", type=int, default=1000)
    prefix.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    lora = sub.add_parser("lora", parents=[serving_load], help="the offline load spread over LoRA adapters vs the "
                          "base model alone")
    lora.add_argument("--adapters", type=int, default=4, help="adapters the requests are spread over")
    lora.add_argument("--rank", type=int, default=16, help="their rank")
    lora.add_argument("--targets", nargs="+", default=list(LORA_TARGETS), choices=LORA_TARGETS,
                      help="the projections they adapt (default: every attention and MLP projection)")
    lora.add_argument("--repeat", type=int, default=3, help="rounds; the median of each engine's is shown")
    fair = sub.add_parser("fairness", help="decode inter-token latency while a long prompt is prefilled")
    fair.add_argument("--streams", type=int, default=16)
    fair.add_argument("--long-prompt", type=int, default=2000)
    fair.add_argument("--budget", type=int, nargs="+", default=[256, 2048], help="max_num_batched_tokens values")
    fair.add_argument("--steps", type=int, default=32, help="steps measured without, then with the long prompt")
    fair.add_argument("--prefill-cap", type=int, default=None,
                      help="max_prefill_tokens_while_decoding (default: none, the whole budget)")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the CPU worker does (workers/serving/host_memory.py)
    if args.command == "worker":
        asyncio.run(run_worker(args))  # loads the model on the engine thread itself
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_as_asked(args)
    commands = {"decode": run_decode, "packing": run_packing, "fusion": run_fusion, "offline": run_offline,
                "prefix": run_prefix, "fairness": run_fairness, "lora": run_lora, "direct": run_direct,
                "attention": run_attention, "deterministic": run_deterministic, "fused": run_fused}
    commands[args.command](args, loaded)


if __name__ == "__main__":
    main()
