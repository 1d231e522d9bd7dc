"""Offline engine benchmark: decode-step time of `LLMEngine.step()` vs the raw HF forward.

    python -m workers.bench_engine --batch 1 16 32

No Ray, no HTTP: the ceiling the serving path is compared against.
"""

from __future__ import annotations

import argparse
import time

import torch

from workers.attention import register_paged_attention
from workers.engine import EngineLimits, LLMEngine
from workers.model_loader import load_model
from workers.sampling_params import SamplingParams

PROMPT = "Write a long story about a robot who learns to paint."


@torch.inference_mode()
def raw_decode_ms(model, prompt_ids: list[int], batch: int, steps: int) -> float:
    out = model(torch.tensor([prompt_ids] * batch), use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - start) / steps * 1000


def engine_decode_ms(model, prompt_ids: list[int], batch: int, steps: int) -> float:
    engine = LLMEngine(model, frozenset(), EngineLimits(kv_cache_bytes=512 * 2**20), torch.device("cpu"))
    for _ in range(batch):
        engine.add_request(prompt_ids, SamplingParams(max_tokens=steps + 8, temperature=0.8, ignore_eos=True))
    engine.step()  # prefill everyone
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.source)
    model, prompt_ids = loaded.model, loaded.tokenizer(PROMPT)["input_ids"]
    for batch in args.batch:
        model.set_attn_implementation("sdpa")
        raw = raw_decode_ms(model, prompt_ids, batch, args.steps)
        model.set_attn_implementation(register_paged_attention())
        eng = engine_decode_ms(model, prompt_ids, batch, args.steps)
        print(f"batch={batch:<3} raw HF {raw:7.1f} ms/step ({batch * 1000 / raw:6.1f} tok/s)   "
              f"engine {eng:7.1f} ms/step ({batch * 1000 / eng:6.1f} tok/s)", flush=True)


if __name__ == "__main__":
    main()
