"""Offline engine benchmark: decode-step time of `LLMEngine.step()` vs the raw HF forward.

    python -m workers.bench_engine --batch 1 16 32
    python -m workers.bench_engine --batch 1 16 --guided   # also: every row under a JSON schema

No Ray, no HTTP: the ceiling the serving path is compared against. With --guided the
engine runs the same batch a second time with each request constrained by
BENCH_SCHEMA (an array of at least 1000 objects, so no row can finish early), and
reports the time spent building the grammar mask and applying it to the logits.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from workers.attention import register_paged_attention
from workers.engine import EngineLimits, LLMEngine
from workers.model_loader import load_model
from workers.sampling_params import GuidedDecoding, SamplingParams

PROMPT = "Write a long story about a robot who learns to paint."
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


@torch.inference_mode()
def raw_decode_ms(model, prompt_ids: list[int], batch: int, steps: int) -> float:
    out = model(torch.tensor([prompt_ids] * batch), use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - start) / steps * 1000


def engine_decode_ms(model, prompt_ids: list[int], batch: int, steps: int, tokenizer=None) -> tuple[float, float]:
    """(ms per decode step, ms of it spent on the grammar mask); guided when `tokenizer` is given."""
    engine = LLMEngine(model, frozenset(), EngineLimits(kv_cache_bytes=512 * 2**20), torch.device("cpu"),
                       tokenizer=tokenizer)
    guided = GuidedDecoding("json_schema", json.dumps(BENCH_SCHEMA)) if tokenizer is not None else None
    for _ in range(batch):
        engine.add_request(prompt_ids, SamplingParams(max_tokens=steps + 8, temperature=0.8, ignore_eos=True,
                                                      guided=guided))
    mask_s = _time_masks(engine)
    engine.step()  # prefill everyone
    engine.step()
    mask_s[0] = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    assert engine.num_active == batch, "a request finished early: the timing would mix batch sizes"
    return (time.perf_counter() - start) / steps * 1000, mask_s[0] / steps * 1000


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--guided", action="store_true", help="also time every row under a JSON schema")
    parser.add_argument("--repeat", type=int, default=1, help="runs per setting, interleaved; the fastest is shown "
                        "(on a shared machine the minimum is the least disturbed)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.source)
    model, prompt_ids = loaded.model, loaded.tokenizer(PROMPT)["input_ids"]
    for batch in args.batch:
        runs = [_one_run(model, prompt_ids, batch, args.steps, loaded.tokenizer if args.guided else None)
                for _ in range(args.repeat)]
        raw, eng = min(r[0] for r in runs), min(r[1] for r in runs)
        line = (f"batch={batch:<3} raw HF {raw:7.1f} ms/step ({batch * 1000 / raw:6.1f} tok/s)   "
                f"engine {eng:7.1f} ms/step ({batch * 1000 / eng:6.1f} tok/s)")
        if args.guided:
            guided, mask = min(r[2] for r in runs), min(r[3] for r in runs)
            line += f"   guided {guided:7.1f} ms/step ({batch * 1000 / guided:6.1f} tok/s, mask {mask:5.2f} ms)"
        print(line, flush=True)


def _one_run(model, prompt_ids: list[int], batch: int, steps: int, tokenizer) -> tuple[float, float, float, float]:
    """(raw HF, engine, guided engine, of which the mask) ms per step; guided only with a tokenizer."""
    model.set_attn_implementation("sdpa")
    raw = raw_decode_ms(model, prompt_ids, batch, steps)
    model.set_attn_implementation(register_paged_attention())
    eng, _ = engine_decode_ms(model, prompt_ids, batch, steps)
    guided, mask = engine_decode_ms(model, prompt_ids, batch, steps, tokenizer) if tokenizer else (0.0, 0.0)
    return raw, eng, guided, mask


if __name__ == "__main__":
    main()
