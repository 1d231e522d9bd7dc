"""Running a batch of greedy requests through an engine, for tests that compare engines."""

from __future__ import annotations

from workers.contract.sampling_params import SamplingParams
from workers.engine.llm_engine import LLMEngine


def greedy_outputs(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int],
                   loras: list[str | None] | None = None) -> list[list[int]]:
    """Add every prompt at once (greedy, EOS ignored; `loras`: each one's adapter key), step
    to the end; tokens per prompt."""
    loras = loras or [None] * len(prompts)
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), lora=k)
           for p, m, k in zip(prompts, max_tokens, loras)]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for ev in engine.step():
            if ev.token_id >= 0:
                out[ev.request_id].append(ev.token_id)
    return [out[i] for i in ids]
