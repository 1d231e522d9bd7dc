"""Where a request's first token goes on the worker: reaching the engine's queue, waiting
for a step, the step that makes the first token (the prefill), and delivery to the caller.

    python -m tools.bench.worker_ttft --requests 12

Requests run one at a time through the worker's request path in this process, as
`python -m tools.bench.engine worker` runs them (no Ray, no HTTP). The parts add up to the
TTFT that path gives. Set beside the Serve path's TTFT at c=1 (`make bench-cpu`), they tell
the worker's share apart from Serve's hops, the HTTP edge and a prefill slowed by the
processes it shares the cores with.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, fields

from tools.bench.engine import BENCH_PROMPT, SERVE_CONFIG, start_worker
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams
from workers.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class TtftSplit:
    """One request's time to its first token, in parts that add up to it."""

    to_queue_ms: float  # the caller's generate() -> LLMEngine.add_request (templating, tokenizing, the thread hop)
    queued_ms: float  # add_request -> the start of the step that made the first token
    first_step_ms: float  # that step: the (last chunk of the) prefill and the first sample
    delivery_ms: float  # the step's end -> the first chunk in the caller's hands

    @property
    def total_ms(self) -> float:
        return self.to_queue_ms + self.queued_ms + self.first_step_ms + self.delivery_ms


class EngineClock:
    """Notes, on one engine instance, when a request was last added and when the first step
    since then that returned events began and ended. The engine's thread writes the marks;
    the caller reads them once the first chunk arrived, which that step's end precedes."""

    def __init__(self, engine: LLMEngine) -> None:
        self.reset()
        add_request, step = engine.add_request, engine.step

        def timed_add_request(*args, **kwargs):
            self.added = time.perf_counter()
            return add_request(*args, **kwargs)

        def timed_step(*args, **kwargs):
            began = time.perf_counter()
            events = step(*args, **kwargs)
            if events and self.step_ended is None:
                self.step_began, self.step_ended = began, time.perf_counter()
            return events

        engine.add_request, engine.step = timed_add_request, timed_step

    def reset(self) -> None:
        self.added: float | None = None
        self.step_began: float | None = None
        self.step_ended: float | None = None


async def split_one(processor, clock: EngineClock, request: GenerateRequest) -> TtftSplit:
    clock.reset()
    start = time.perf_counter()
    first = None
    async for _ in processor.stream(request):
        if first is None:
            first = time.perf_counter()
    return TtftSplit((clock.added - start) * 1000, (clock.step_began - clock.added) * 1000,
                     (clock.step_ended - clock.step_began) * 1000, (first - clock.step_ended) * 1000)


async def measure(source: str, requests: int, max_tokens: int, prompt: str = BENCH_PROMPT, dtype: str = "auto",
                  config_path: str = SERVE_CONFIG, warmup: int = 2) -> list[TtftSplit]:
    """The split of `requests` requests, one after another, after `warmup` unmeasured ones."""
    clocks: list[EngineClock] = []
    engine, processor = await start_worker(source, dtype=dtype, config_path=config_path,
                                           on_build=lambda built: clocks.append(EngineClock(built)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, ignore_eos=True)
    try:
        splits = []
        for i in range(warmup + requests):
            request = GenerateRequest(request_id=f"ttft-{i}", params=params, max_tokens=max_tokens,
                                      messages=[{"role": "user", "content": prompt}])
            split = await split_one(processor, clocks[0], request)
            if i >= warmup:
                splits.append(split)
        return splits
    finally:
        engine.stop()


def summary_lines(splits: list[TtftSplit]) -> list[str]:
    lines = []
    for part in fields(TtftSplit):
        values = [getattr(split, part.name) for split in splits]
        lines.append(f"{part.name:14s} median {statistics.median(values):8.2f} ms   max {max(values):8.2f} ms")
    totals = [split.total_ms for split in splits]
    lines.append(f"{'ttft_ms':14s} median {statistics.median(totals):8.2f} ms   max {max(totals):8.2f} ms")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--config", default=SERVE_CONFIG, help="serve config whose first model's engine limits "
                        "the engine takes (default: configs/default.yaml)")
    parser.add_argument("--requests", type=int, default=12, help="measured, after 2 unmeasured")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt", default=BENCH_PROMPT)
    args = parser.parse_args(argv)
    splits = asyncio.run(measure(args.source, args.requests, args.max_tokens, args.prompt, args.dtype, args.config))
    for line in summary_lines(splits):
        print(line)


if __name__ == "__main__":
    main()
