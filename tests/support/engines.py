"""Engine test helpers: a tiny engine, prompts of several lengths, running it to completion,
transformers' greedy reference, the engine behind asyncio, and the tiny model's chat
template by hand."""

from __future__ import annotations

import asyncio
import time

import torch

from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams
from workers.core.limits import EngineLimits
from workers.engine.llm_engine import LLMEngine
from workers.parallel.shard_loop import shard_kv_shape
from workers.serving.async_engine import AsyncEngine
from workers.speculative.proposals import StepCost

CPU = torch.device("cpu")

PROMPT_TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is",
    "def add(a, b):\n    return",
    "Unicode: café naïve 你好 世界 😀 — emoji and accents, numbers 0 1 2 3 4 5 6 7 8 9",
]


def prompt_ids(tokenizer) -> list[list[int]]:
    """PROMPT_TEXTS tokenized: five prompts of different lengths."""
    ids = [tokenizer(t)["input_ids"] for t in PROMPT_TEXTS]
    assert len({len(p) for p in ids}) == len(ids)  # all different lengths
    return ids


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def make_engine(model, num_blocks=256, block_size=4, eos=frozenset(), tokenizer=None, shard_group=None,
                stage=None, draft_model=None, learn_step_cost=False, **limits) -> LLMEngine:
    """`shard_group`: `model` is the driver's part of a split model (workers/parallel/), by
    tensors, or by layers when `stage` (its first pipeline stage) is given. `draft_model`:
    speculative method 'draft's. A proposer prices its tokens at the fixed prior unless
    `learn_step_cost` (the measured price follows step timings, which a loaded test machine
    makes noisy: the tests' proposal counts would too)."""
    per_token = shard_kv_shape(model, shard_group.world if shard_group else 1, stage).bytes_per_token
    limits = EngineLimits(block_size=block_size, kv_cache_bytes=num_blocks * block_size * per_token, **limits)
    engine = LLMEngine(model, eos, limits, CPU, tokenizer=tokenizer, shard_group=shard_group, stage=stage,
                       draft_model=draft_model)
    assert engine.blocks.num_blocks == num_blocks
    if engine.proposer is not None and not learn_step_cost:
        engine.proposer.step_cost = StepCost(engine.proposer.step_cost.prior, learn=False)
    return engine


def run_to_completion(engine: LLMEngine, max_steps: int = 2000) -> dict[int, list]:
    events: dict[int, list] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return events
        for ev in engine.step():
            events.setdefault(ev.request_id, []).append(ev)
    raise AssertionError("engine did not finish")


def tokens_by_choice(events: list) -> dict[int, list[int]]:
    """One request's sampled token ids per choice (events with no token, as a finished
    beam's or an error's, left out)."""
    choices: dict[int, list[int]] = {}
    for event in events:
        if event.token_id >= 0:
            choices.setdefault(event.index, []).append(event.token_id)
    return choices


def greedy_outputs(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int],
                   loras: list[str | None] | None = None) -> list[list[int]]:
    """Add every prompt at once (greedy, EOS ignored; `loras`: each one's adapter key), run
    to the end; the token ids of each prompt's answer."""
    loras = loras or [None] * len(prompts)
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), lora=k)
           for p, m, k in zip(prompts, max_tokens, loras)]
    events = run_to_completion(engine)
    return [[ev.token_id for ev in events.get(i, []) if ev.token_id >= 0] for i in ids]


def record_preemptions(engine: LLMEngine) -> list:
    """Wrap the scheduler so the test can see which sequences each step preempted."""
    preempted: list = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        preempted.extend(batch.preempted)
        return batch

    engine.scheduler.schedule = recording_schedule
    return preempted


_REFERENCE: dict[tuple, list[int]] = {}


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy decoding, EOS disabled."""
    key = (tuple(prompt), n)
    if key not in _REFERENCE:
        x = torch.tensor([prompt])
        out = model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0
        )
        tokens = out[0, len(prompt) :].tolist()
        assert len(tokens) == n
        _REFERENCE[key] = tokens
    return _REFERENCE[key]


async def wait_idle(engine: LLMEngine | AsyncEngine, timeout: float = 5.0) -> None:
    """Aborts reach the engine thread through its command queue: give it a moment."""
    deadline = time.monotonic() + timeout
    while ((stats := engine.stats()).kv_blocks_used or stats.active_requests) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


async def with_async_engine(engine: LLMEngine, body):
    aengine = AsyncEngine(engine)
    aengine.start(asyncio.get_running_loop())
    try:
        return await asyncio.wait_for(body(aengine), timeout=30)
    finally:
        aengine.stop()
        assert not aengine._thread.is_alive()


def chat_request(text: str, max_tokens: int | None, **params) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        params=SamplingParams(temperature=0.0, **params),
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
    )


def template_ids(tokenizer, text: str) -> list[int]:
    # The tiny model's template written out by hand (tests/support/tiny_models.py CHAT_TEMPLATE).
    rendered = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


async def generate(processor, request):
    """A request's chunks one by one, from a RequestProcessor (which hands out each
    wake-up's chunks as one list)."""
    async for batch in processor.stream(request):
        for chunk in batch:
            yield chunk


def complete_step(scheduler, batch, sampled: list[int]):
    """What the engine does after a step, for scheduler tests without a model: advance the
    computed counts, append the sampled tokens, retire finished sequences."""
    scheduler.advance(batch)
    return scheduler.append_tokens([c.seq for c in batch.sampling_chunks], sampled)


class QueuedEvents:
    """A RequestStream's events queued for a test to read, a step's batch at a time (the
    worker's ActiveRequest takes them as its sink instead)."""

    def __init__(self, stream) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        stream.sink = self._queue.put_nowait

    async def next_batch(self) -> list:
        """The next step's events of the request; raises the exception that failed it."""
        items = await self._queue.get()
        for item in items:
            if isinstance(item, BaseException):
                raise item
        return items

    async def __aiter__(self):
        while not self.finished:
            events = await self.next_batch()
            self.finished = any(e.request_finished for e in events)
            yield events
