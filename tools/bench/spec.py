"""Speculative decoding's benchmark (`make bench-spec`): the default model in the engine,
speculation off and on, at concurrency 1 and 16, on two loads:

- edit: "fix the typos in this text", greedy; the answer repeats most of the prompt, which
  is where prompt-lookup proposals are taken;
- chat: tools.bench.load's story prompt at temperature 0.8 (the plain load, where
  proposals are rarely right and must cost little).

    python -m tools.bench.spec --concurrency 1 16 --rounds 2

Each (load, concurrency) runs off and on in turn, `--rounds` times; each figure is the
median of its rounds (this machine's noise is +-20 % between runs minutes apart). The
engine takes configs/default.yaml's limits, plus `speculative` with the numbers given
(`--disable-by-batch-size 0` lets a step of any batch propose: what it costs at c=16).
Reported: output tok/s, TPOT, and with speculation the tokens accepted per proposal and
the mean tokens a verification step gave its sequence. For the edit load, also its
ceiling: the greedy answer (up to the end of its turn) replayed through the same prompt
lookup, the tokens a step would give if a verification cost no more than a plain step, at
`--num-speculative-tokens` and at 16 proposals (what the answer's own text allows,
whatever the engine's speed); and the same answer paced as the engine paces proposals, at
fixed prices of a fed row (a share of a step: ~0.2-0.3 for the default model on 2 CPU
cores), the speed-up the text and the price allow.

`--method draft` proposes with a draft model: `--draft-source` (any model source with the
default model's tokenizer), or by default the default model's own first `--draft-layers`
layers (no smaller model with its tokenizer is at hand offline; such a draft proposes
what the early layers already make of the text)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from tools.bench.engine import (
    BENCH_PROMPT,
    SERVE_CONFIG,
    percentile,
    served_model_config,
)
from workers.contract.model_config import SpeculativeConfig
from workers.contract.sampling_params import SamplingParams
from workers.engine.kv_sizing import sized_engine_limits
from workers.engine.llm_engine import LLMEngine
from workers.model.attention import register_paged_attention
from workers.model.loader import load_model
from workers.serving.host_memory import keep_freed_memory
from workers.speculative.ngram_proposer import NgramIndex
from workers.speculative.proposals import ProposalPace
from workers.speculative.verification import accepted_count

EDIT_TEXT = (
    "Ray Serve is a scalable model serving library for building online inference APIs. Serve is framework "
    "agnostic, so you can use a single toolkit to serve everything from deep learning models built with "
    "frameworks like PyTorch, Tensorflow, and Keras, to Scikit-Learn models, to arbitrary Python buisness logic. "
    "It has several features and performance optimizations for serving Large Language Models such as response "
    "streaming, dynamic request batching, multi-node/multi-GPU serving, etc. Serve is particularly well suited "
    "for model composition and many model serving, enabling you to build a complex inference service consisting "
    "of multiple ML models and buisness logic all in Python code."
)
ROW_PRICES = (0.0, 0.1, 0.2, 0.3)  # a fed row's cost as a share of a one-row step, for the paced replay
EDIT_PROMPT = f"Fix the spelling mistakes in this text and write it out again in full:\n\n{EDIT_TEXT}"


@dataclasses.dataclass
class Level:
    load: str
    concurrency: int
    speculative: bool
    output_tok_s: float
    tpot_median_ms: float
    tpot_p99_ms: float
    accepted_per_draft_token: float = 0.0  # accepted / proposed
    tokens_per_verification: float = 0.0  # 1 + accepted / verification chunks


def run_level(engine: LLMEngine, prompt: list[int], params: SamplingParams, concurrency: int,
              requests: int) -> tuple[float, list[float]]:
    """Closed loop at `concurrency` until `requests` are done: output tok/s and each request's TPOT (ms)."""
    times: dict[int, list[float]] = {}
    added = 0

    def add() -> None:
        nonlocal added
        times[engine.add_request(prompt, params)] = []
        added += 1

    for _ in range(min(concurrency, requests)):
        add()
    start = time.perf_counter()
    while engine.has_work():
        for event in engine.step():
            times[event.request_id].append(event.time)
            if event.request_finished and added < requests:
                add()
    wall = time.perf_counter() - start
    tokens = sum(len(t) for t in times.values())
    tpots = [(t[-1] - t[0]) / (len(t) - 1) * 1000 for t in times.values() if len(t) > 1]
    return tokens / wall, tpots


def measure(engines: dict[bool, LLMEngine], loads: dict[str, tuple[list[int], SamplingParams]],
            levels: list[int], rounds: int) -> list[Level]:
    out = []
    for load, (prompt, params) in loads.items():
        for concurrency in levels:
            runs: dict[bool, list[tuple[float, list[float]]]] = {False: [], True: []}
            counts = {}
            for _ in range(rounds):
                for speculative, engine in engines.items():
                    before = dataclasses.replace(engine.proposer.counts) if engine.proposer else None
                    runs[speculative].append(run_level(engine, prompt, params, concurrency, max(4, 2 * concurrency)))
                    if before is not None:
                        after = engine.proposer.counts
                        counts = {k: counts.get(k, 0) + getattr(after, k) - getattr(before, k)
                                  for k in ("drafts", "draft_tokens", "accepted_tokens")}
            for speculative, results in runs.items():
                tpots = [t for _, ts in results for t in ts]
                level = Level(load, concurrency, speculative, statistics.median(r for r, _ in results),
                              statistics.median(tpots), percentile(tpots, 99))
                if speculative and counts.get("drafts"):
                    level.accepted_per_draft_token = counts["accepted_tokens"] / counts["draft_tokens"]
                    level.tokens_per_verification = 1 + counts["accepted_tokens"] / counts["drafts"]
                out.append(level)
                print(line(level), flush=True)
    return out


def replayed_steps(prompt: list[int], answer: list[int], shortest: int, longest: int,
                   proposal_length: Callable[[int], int]) -> Iterator[tuple[int, int]]:
    """`answer` after `prompt` replayed step by step with prompt lookup (as NgramProposer
    makes proposals), each step taking its proposal up to the first wrong token plus its own
    token: (tokens proposed, tokens accepted) a step. A proposal's length is
    `proposal_length(answer tokens left)`, asked after the previous step was handed back;
    the first token comes from the prefill."""
    index, tokens, done = NgramIndex(shortest, longest), list(prompt), 0
    while done < len(answer):
        room = len(answer) - done
        count = proposal_length(room) if done else 0
        proposal = index.lookup(tokens, count) if count else []
        taken = accepted_count(answer[done:], tuple(proposal[:room]))
        yield len(proposal), taken
        step = min(taken + 1, room)
        tokens += answer[done:done + step]
        done += step


def lookup_ceiling(prompt: list[int], answer: list[int], proposals: int, shortest: int, longest: int) -> float:
    """Tokens a step for `answer` after `prompt` when every step proposes `proposals`
    tokens: the most speculation can give this text if verifying cost nothing."""
    steps = sum(1 for _ in replayed_steps(prompt, answer, shortest, longest, lambda room: proposals))
    return len(answer) / steps if steps else 0.0


def paced_replay(prompt: list[int], answer: list[int], proposals: int, shortest: int, longest: int,
                 row_price: float) -> float:
    """Output speed-up over plain decoding for `answer` after `prompt` when each step proposes
    what the engine's own pacing asks for (ProposalPace at a fixed `row_price`: a proposed
    token costs that share of a step), the step costing 1 + row_price x its proposals: what
    the pacing can make of this text on a machine where a fed row costs that much, without
    the engine's other overheads."""
    pace, spent = ProposalPace(proposals, row_price), 0.0
    for proposed, taken in replayed_steps(prompt, answer, shortest, longest, pace.next_length):
        if proposed:
            pace.record(proposed, taken)
        spent += 1 + row_price * proposed
    return len(answer) / spent if spent else 0.0


def greedy_answer(engine: LLMEngine, prompt: list[int], max_tokens: int, end_id: int | None) -> list[int]:
    """The engine's greedy answer to `prompt`, cut after `end_id` (the end of the turn)."""
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    answer = []
    while engine.has_work():
        answer += [event.token_id for event in engine.step()]
    return answer[:answer.index(end_id) + 1] if end_id in answer else answer


def line(level: Level) -> str:
    spec = (f"  accepted/proposed={level.accepted_per_draft_token:.2f} tokens/verification="
            f"{level.tokens_per_verification:.2f}" if level.speculative else "")
    return (f"{level.load:<5} c={level.concurrency:<3} speculation={'on ' if level.speculative else 'off'} "
            f"tok/s={level.output_tok_s:7.1f}  TPOT med={level.tpot_median_ms:6.1f} p99={level.tpot_p99_ms:6.1f} ms"
            + spec)


def first_layers(model: torch.nn.Module, count: int) -> torch.nn.Module:
    """A copy of a decoder-only model with only its first `count` layers (then its own
    final norm and head): a draft with the model's tokenizer."""
    draft = copy.deepcopy(model)
    del draft.model.layers[count:]
    draft.config.num_hidden_layers = count
    return draft


def load_draft(args: argparse.Namespace, config, target) -> torch.nn.Module | None:
    if args.method != "draft":
        return None
    if args.draft_source is None:
        return first_layers(target, args.draft_layers)
    loaded = load_model(args.draft_source, dtype=config.dtype, quantization=config.quantization,
                        quantized_activations=config.quantized_activations)
    loaded.model.set_attn_implementation(register_paged_attention())
    return loaded.model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--method", default="ngram", choices=["ngram", "suffix", "draft"],
                        help="suffix: ngram plus the engine's earlier answers (the loads repeat one request, so "
                        "from the second request on it replays the first's answer)")
    parser.add_argument("--draft-source", default=None, help="method draft: the draft model's source")
    parser.add_argument("--draft-layers", type=int, default=8,
                        help="method draft without --draft-source: the default model's first layers as the draft")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=SpeculativeConfig.model_fields[
                        "disable_by_batch_size"].default, help="as the config's (default: the config's default; "
                        "0: none, so every step may propose)")
    parser.add_argument("--loads", nargs="+", default=["edit", "chat"], choices=["edit", "chat"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    keep_freed_memory()
    config = served_model_config(SERVE_CONFIG)
    spec = SpeculativeConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens,
                             prompt_lookup_min=args.lookup_min, prompt_lookup_max=args.lookup_max,
                             disable_by_batch_size=args.disable_by_batch_size or None,
                             draft_source=(args.draft_source or f"first {args.draft_layers} layers")
                             if args.method == "draft" else None)
    loaded = load_model(args.source, dtype=config.dtype, quantization=config.quantization,
                        quantized_activations=config.quantized_activations)
    loaded.model.set_attn_implementation(register_paged_attention())
    cpu = torch.device("cpu")
    draft = load_draft(args, config, loaded.model)
    engines = {flag: LLMEngine(loaded.model, frozenset(),
                               sized_engine_limits(config.model_copy(update={"speculative": spec if flag else None}),
                                                   loaded.model, cpu), cpu, draft_model=draft if flag else None)
               for flag in (False, True)}

    def chat_ids(text: str) -> list[int]:
        return loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)

    loads = {
        "edit": (chat_ids(EDIT_PROMPT), SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)),
        "chat": (chat_ids(BENCH_PROMPT), SamplingParams(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True)),
    }
    for engine in engines.values():  # warm-up
        run_level(engine, loads["chat"][0], SamplingParams(max_tokens=8), 1, 1)
    levels = measure(engines, {k: loads[k] for k in args.loads}, args.concurrency, args.rounds)
    ceiling, paced = {}, {}
    if "edit" in args.loads:
        prompt = loads["edit"][0]
        end_of_turn = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
        answer = greedy_answer(engines[False], prompt, args.max_tokens, end_of_turn)
        ceiling = {k: lookup_ceiling(prompt, answer, k, args.lookup_min, args.lookup_max)
                   for k in sorted({args.num_speculative_tokens, 16})}
        print(f"edit ceiling: the greedy answer's {len(answer)} tokens by prompt lookup, verification free: "
              + ", ".join(f"{v:.2f} tokens a step at {k} proposals" for k, v in ceiling.items()), flush=True)
        paced = {price: paced_replay(prompt, answer, args.num_speculative_tokens, args.lookup_min, args.lookup_max,
                                     price) for price in ROW_PRICES}
        print(f"edit paced: the same answer with the engine's pacing at {args.num_speculative_tokens} proposals, a fed "
              "row costing a share of a step: " + ", ".join(f"{v:.2f}x at {p}" for p, v in paced.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu_threads": torch.get_num_threads(), "levels": [dataclasses.asdict(x) for x in levels],
                       "speculative": spec.model_dump(), "edit_ceiling_tokens_a_step": ceiling,
                       "edit_paced_speedup_by_row_price": paced}, f, indent=2)


if __name__ == "__main__":
    main()
