"""Does a request's output depend on what else the engine runs? The default model in the
engine (no Serve), `engine.deterministic` off and on, in each dtype asked: 16 requests
(8 greedy, 8 seeded at temperature 0.9) each run alone, then

- among 63 others (of other lengths, added at once),
- with another chunked-prefill budget (`max_num_batched_tokens` 48, beside 15 others),
- after a prefix-cache hit (the same prompts run once before, in the same engine),
- resumed half way (the first half of its own output replayed, as a resumed stream is),

and the script counts the requests whose tokens equal their run alone.

    python -m tools.reliability.determinism --dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
import copy
import random

import torch

from tools.bench.engine import SERVE_CONFIG, configured_engine, served_model_config
from workers.contract.sampling_params import SamplingParams
from workers.engine.llm_engine import LLMEngine
from workers.model.attention import register_paged_attention
from workers.model.loader import load_model

TOPICS = ("cats dogs ships trains rivers mountains bread jazz snow maps clocks bees tea kites glass owls salt moss "
          "rain lamps ink wool corn bells").split()
MAX_TOKENS = 48


def prompt_text(k: int) -> str:
    """Request k's user message (determinism_serve.py sends the same ones)."""
    return f"Write {1 + k % 4} sentences about {TOPICS[k % len(TOPICS)]} and {TOPICS[(3 * k + 1) % len(TOPICS)]}."


def sampling(k: int) -> dict:
    """Request k's sampling: even ones greedy, odd ones seeded at temperature 0.9."""
    return {"temperature": 0.0} if k % 2 == 0 else {"temperature": 0.9, "seed": k}


def requests(tokenizer, count: int, offset: int = 0) -> list[tuple[list[int], SamplingParams]]:
    out = []
    for k in range(offset, offset + count):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text(k)}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        out.append((ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling(k))))
    return out


def run(engine: LLMEngine, batch: list[tuple[list[int], SamplingParams]], resume: dict[int, list[int]] | None = None,
        ) -> list[list[int]]:
    """Each request's output ids (a resumed one's whole output, the replayed part included)."""
    ids = []
    for i, (prompt, params) in enumerate(batch):
        replay = None
        if resume is not None and i in resume:
            replay = engine.replay_output(prompt, params, {0: resume[i]}, None)
        ids.append(engine.add_request(prompt, params, resume=replay))
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for event in engine.step():
            tokens[event.request_id].append(event.token_id)
    return [(resume[i] if resume and i in resume else []) + tokens[r] for i, r in enumerate(ids)]


def scenarios(model, config, targets, tokenizer) -> dict[str, int]:
    """How many targets equal their run alone, per scenario."""
    def engine(**engine_fields) -> LLMEngine:
        fields = config.engine.model_copy(update=engine_fields)
        return configured_engine(model, config.model_copy(update={"engine": fields}))

    plain = engine()
    alone = [run(plain, [t])[0] for t in targets]
    others = requests(tokenizer, 63, offset=100)
    random.Random(0).shuffle(others)
    crowded = run(plain, targets + others)[: len(targets)]
    chunked = run(engine(max_num_batched_tokens=48), targets + others[:15])[: len(targets)]
    cached = engine(enable_prefix_caching=True)
    run(cached, targets)
    after_hit = run(cached, targets)
    resumed = run(engine(), targets, resume={i: out[: MAX_TOKENS // 2] for i, out in enumerate(alone)})
    return {name: sum(a == b for a, b in zip(alone, outs)) for name, outs in
            (("among 63 others", crowded), ("budget 48", chunked), ("after a cache hit", after_hit),
             ("resumed half way", resumed))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--source", default="builtin:smollm2-135m-instruct")
    args = parser.parse_args(argv)
    config = served_model_config(SERVE_CONFIG)
    for dtype in args.dtype:
        loaded = load_model(args.source, dtype=dtype, quantization=config.quantization,
                            quantized_activations=config.quantized_activations)
        loaded.model.set_attn_implementation(register_paged_attention())
        targets = requests(loaded.tokenizer, 16)
        for deterministic in (False, True):
            model = copy.deepcopy(loaded.model)  # the mode wraps the layers in place
            mode = config.model_copy(update={"engine": config.engine.model_copy(update={"deterministic": deterministic})})
            counts = scenarios(model, mode, targets, loaded.tokenizer)
            line = ", ".join(f"{name} {count}/16" for name, count in counts.items())
            print(f"{dtype} deterministic={'on ' if deterministic else 'off'} ({torch.get_num_threads()} threads): "
                  f"{line}", flush=True)


if __name__ == "__main__":
    main()
