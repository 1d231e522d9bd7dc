"""Speculative decoding on a GPU shape (issue "One user, fast": ngram and draft on a
random-weight 1B target with a smaller draft): what a fed row costs the device, and the
two methods at concurrency 1 against no speculation, in one run.

    python -m tools.bench.gpu_spec --shape 1b        # on a GPU (bfloat16, the target's CUDA graphs on)
    python -m tools.bench.gpu_spec --tiny            # CPU smoke run of the same code (a test runs it)

Per shape it prints:
- the row price: a decode step at 1, 2, 3, 5, 9 and 17 rows, replayed from CUDA graphs and
  eager (a verification step runs eager: its rows are a span of one sequence), and each
  extra row's cost as a share of the one-row step: speculation pays while the chance that
  a proposal is taken beats that share (workers/speculative/proposals.py);
- ngram (k proposals, prompt lookup 1-4) and draft (a 2-layer random model with the
  target's vocabulary, k proposals) at concurrency 1 against no speculation: output tok/s,
  accepted / proposed, tokens a verification step. The prompts repeat a random segment so
  that lookup has something to find; with random weights the model's text follows nothing
  in particular, so acceptance is whatever it is: the step costs are the point, and the
  same code runs a real checkpoint's load through tools.bench.spec.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM

from tools.bench.gpu import (
    SHAPES,
    Load,
    bench_device,
    build_model,
    engine_decode_ms,
    free_device_memory,
    make_engine,
    random_prompts,
    sync_device,
    write_reports,
)
from workers.contract.sampling_params import SamplingParams
from workers.core.limits import SpeculativeLimits
from workers.model.attention import register_paged_attention
from workers.model.fused_projections import fuse_sibling_projections

ROWS = (1, 2, 3, 5, 9, 17)
DRAFT_LAYERS = 2
# ngram lookup from single tokens: a random model's text matches its prompt rarely, but it falls
# into loops of its own, which lookup then finds in the output.
LOOKUP = (1, 4)


@dataclass
class RowPrice:
    rows: int
    graph_ms: float | None  # replayed from CUDA graphs (None off CUDA)
    eager_ms: float


@dataclass
class MethodRun:
    method: str  # "off", "ngram" or "draft"
    tok_s: float
    accepted_per_proposed: float
    tokens_per_verification: float


@dataclass
class SpecReport:
    shape: str
    device: str
    dtype: str
    prices: list[RowPrice]
    runs: list[MethodRun]

    def lines(self) -> list[str]:
        one = self.prices[0]
        out = [f"{self.shape} on {self.device} ({self.dtype}): decode step by rows, and each extra row as a "
               "share of the one-row step"]
        for p in self.prices:
            graph = f"{p.graph_ms:7.2f} ms" if p.graph_ms is not None else "    n/a"
            share = (p.eager_ms - one.eager_ms) / (p.rows - 1) / one.eager_ms if p.rows > 1 else 0.0
            out.append(f"  rows {p.rows:2d}: graphs {graph}  eager {p.eager_ms:7.2f} ms  row share (eager) {share:5.3f}")
        off = next(r.tok_s for r in self.runs if r.method == "off")
        for r in self.runs:
            out.append(f"  c=1 {r.method:<5} {r.tok_s:8.1f} tok/s ({r.tok_s / off:4.2f}x)  accepted/proposed "
                       f"{r.accepted_per_proposed:4.2f}  tokens/verification {r.tokens_per_verification:4.2f}")
        return out


def draft_model(shape: str, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """A smaller random Llama with the target's vocabulary: a quarter of its width, two layers."""
    base = SHAPES[shape]
    heads = max(base["num_attention_heads"] // 4, 1)
    model = build_model(shape, dtype, device, seed=1, overrides={
        "hidden_size": base["hidden_size"] // 4, "intermediate_size": base["intermediate_size"] // 4,
        "num_hidden_layers": DRAFT_LAYERS, "num_attention_heads": heads,
        "num_key_value_heads": min(base["num_key_value_heads"], heads)})
    model.set_attn_implementation(register_paged_attention())  # the engine sets the target's
    return model


def row_prices(model, load: Load, device: torch.device) -> list[RowPrice]:
    """Decode steps of each row count, eager and (on CUDA) from graphs: one engine at a time,
    as each takes its share of the device's memory for its cache."""
    prompts = {rows: random_prompts(load, model.config.vocab_size, rows) for rows in ROWS}

    def timed(cuda_graphs: bool) -> dict[int, float]:
        engine = make_engine(model, load, device, cuda_graphs=cuda_graphs, async_scheduling=False)
        steps = {rows: engine_decode_ms(engine, prompts[rows]).step_ms for rows in ROWS}
        del engine
        free_device_memory(device)
        return steps

    eager = timed(False)
    graphs = timed(True) if device.type == "cuda" else {}
    return [RowPrice(rows, graphs.get(rows), eager[rows]) for rows in ROWS]


def repeating_prompts(load: Load, vocab: int, count: int) -> list[list[int]]:
    """Random prompts of input_len tokens, each a random 32-token segment over and over."""
    gen = torch.Generator().manual_seed(2)
    segments = torch.randint(0, vocab, (count, 32), generator=gen).tolist()
    return [(segment * (load.input_len // 32 + 1))[: load.input_len] for segment in segments]


def run_method(model, draft, load: Load, device: torch.device, method: str, k: int) -> MethodRun:
    """`load.requests` greedy requests one after another (after a warm-up one)."""
    limits = None if method == "off" else SpeculativeLimits(k, LOOKUP[0], LOOKUP[1], None, method=method)
    engine = make_engine(model, load, device, cuda_graphs=device.type == "cuda", async_scheduling=False,
                         speculative=limits, draft_model=draft if method == "draft" else None)
    params = SamplingParams(max_tokens=load.output_len, temperature=0.0, ignore_eos=True)
    prompts = repeating_prompts(load, model.config.vocab_size, load.requests + 1)
    engine.add_request(prompts[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    while engine.has_work():
        engine.step()
    tokens, start = 0, time.perf_counter()
    before = dataclasses.replace(engine.proposer.counts) if engine.proposer else None
    for prompt in prompts[1:]:  # one at a time: concurrency 1
        engine.add_request(prompt, params)
        while engine.has_work():
            tokens += sum(1 for e in engine.step() if e.token_id >= 0)
    sync_device(device)
    tok_s = tokens / (time.perf_counter() - start)
    accepted = proposed = drafts = 0
    if before is not None:
        after = engine.proposer.counts
        drafts = after.drafts - before.drafts
        proposed, accepted = after.draft_tokens - before.draft_tokens, after.accepted_tokens - before.accepted_tokens
    del engine
    free_device_memory(device)
    return MethodRun(method, tok_s, accepted / proposed if proposed else 0.0,
                     1 + accepted / drafts if drafts else 0.0)


def run_shape(shape: str, load: Load, device: torch.device, dtype: torch.dtype, k: int) -> SpecReport:
    model = build_model(shape, dtype, device)
    fuse_sibling_projections(model)
    prices = row_prices(model, load, device)
    draft = draft_model(shape, dtype, device)
    runs = [run_method(model, draft, load, device, method, k) for method in ("off", "ngram", "draft")]
    del model, draft
    free_device_memory(device)
    return SpecReport(shape, device.type, str(dtype).removeprefix("torch."), prices, runs)


def main(argv: list[str] | None = None) -> list[SpecReport]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", choices=sorted(set(SHAPES) - {"tiny"}), default=["1b"])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shape, small load, float32")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--requests", type=int, default=4, help="greedy requests at concurrency 1, per method")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--json", default=None, help="also write the reports here")
    args = parser.parse_args(argv)
    device, dtype = bench_device(parser, args.tiny)
    shapes = ["tiny"] if args.tiny else args.shape
    load = (Load(requests=args.requests, input_len=64, output_len=8, decode_batch=1) if args.tiny
            else Load(args.requests, args.input_len, args.output_len, 1))
    reports = []
    for shape in shapes:
        report = run_shape(shape, load, device, dtype, args.num_speculative_tokens)
        print("\n".join(report.lines()), flush=True)
        reports.append(report)
    write_reports(args.json, load, "reports", reports)
    return reports


if __name__ == "__main__":
    main()
