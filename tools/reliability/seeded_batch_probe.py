"""Does a seeded choice's output depend on the requests that share its batch? No resume,
no Serve: each seed's request runs alone, then again among 15 greedy requests of other
lengths, in the engine on the tiny random model; the script counts the choices whose
tokens differ and where they first do.

Why it exists: a seeded choice draws each token from (seed, choice, position), so its
draws never depend on the batch, but the logits do, by float rounding (matrix products and
attention reduce in an order that depends on the batch's shape). A draw that lands within
that rounding of a boundary of the cumulative distribution picks the neighbouring token,
and the outputs part from there. Resuming a request re-prefills its output in another
batch, so it can part the same way; this measures how often that happens without any resume.

    python -m tools.reliability.seeded_batch_probe --seeds 200
"""

from __future__ import annotations

import argparse
import random

import torch

from tests.support.engines import make_engine, run_to_completion, tokens_by_choice
from tests.support.tiny_models import build_tiny_llama, build_tokenizer
from workers.contract.sampling_params import SamplingParams
from workers.model.attention import register_paged_attention

BATCH_MATES = 15
MAX_TOKENS = 160


def run_batch(model, requests: list[tuple[list[int], SamplingParams]]) -> list[dict[int, list[int]]]:
    """Each request's token ids per choice, all added at once and run to the end."""
    engine = make_engine(model, num_blocks=2048, block_size=16)
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    events = run_to_completion(engine, max_steps=10_000)
    return [tokens_by_choice(events.get(request_id, [])) for request_id in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.9)
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    model = build_tiny_llama(len(tokenizer), max_position_embeddings=1024)  # the fault tests' model
    model.set_attn_implementation(register_paged_attention())

    def prompt(k: int) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"Request {k}: tell me something"}],
                                             add_generation_prompt=True, tokenize=False)
        return tokenizer(text)["input_ids"]

    differing, tokens, first_differences = 0, 0, []
    for seed in range(args.seeds):
        target = (prompt(seed), SamplingParams(max_tokens=MAX_TOKENS, temperature=args.temperature, seed=seed, n=2,
                                               ignore_eos=True))
        alone = run_batch(model, [target])[0]
        rnd = random.Random(seed)
        mates = [(prompt(100 + k), SamplingParams(max_tokens=rnd.randint(20, MAX_TOKENS), temperature=0.0,
                                                  ignore_eos=True)) for k in range(BATCH_MATES)]
        place = rnd.randint(0, BATCH_MATES)
        among = run_batch(model, mates[:place] + [target] + mates[place:])[place]
        for choice, ids in alone.items():
            tokens += len(ids)
            if among[choice] != ids:
                differing += 1
                first_differences.append(next(i for i, (a, b) in enumerate(zip(ids, among[choice])) if a != b))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads: {differing} of {2 * args.seeds} seeded "
          f"choices differ between alone and among {BATCH_MATES} others ({tokens} tokens compared); "
          f"first differing positions: {first_differences}")


if __name__ == "__main__":
    main()
