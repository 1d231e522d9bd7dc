"""Async scheduling (engine.async_scheduling): a plain decode step is launched from the
previous step's sampled ids before they are read back. On CPU nothing overlaps, but the
bookkeeping is the same as on a GPU, so these tests run it here: every output, finish
reason, prefix-cache entry and freed block must equal the synchronous engine's."""

from __future__ import annotations

import torch

from tests.support.engines import (
    greedy_outputs,
    make_engine,
    record_preemptions,
    reference_greedy,
)
from workers.contract.sampling_params import SamplingParams


def _prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(1, 30, (count,), generator=gen)]


def _run(engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[tuple]]:
    """Every event's (choice, token, finish reason), per request."""
    ids = [engine.add_request(p, params) for p, params in requests]
    out: dict[int, list] = {i: [] for i in ids}
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id].append((ev.index, ev.token_id, ev.finish_reason, ev.logprob))
    return [out[i] for i in ids]


def _both(model, requests, **limits):
    sync = make_engine(model, **limits)
    fast = make_engine(model, async_scheduling=True, **limits)
    got = _run(fast, requests)
    assert got == _run(sync, requests)
    assert fast.async_steps > 0 and sync.async_steps == 0
    assert fast.blocks.num_free_blocks == fast.blocks.num_blocks  # every block back
    return got, fast


def test_same_output_as_the_synchronous_engine(paged_model, tiny_model):
    vocab = paged_model.config.vocab_size
    prompts = _prompts(9, vocab)
    requests = [(p, SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts)]
    got, engine = _both(paged_model, requests)
    for (prompt, params), events in zip(requests[:3], got):
        assert [t for _, t, _, _ in events] == reference_greedy(tiny_model, prompt, params.max_tokens)


def test_stops_mid_pipeline_waste_a_row_but_not_the_output(paged_model):
    vocab = paged_model.config.vocab_size
    prompts = _prompts(8, vocab, seed=1)
    # Stop tokens that greedy decoding actually produces, some steps in.
    free_run = greedy_outputs(make_engine(paged_model), prompts, [12] * len(prompts))
    stop_id, eos_id = free_run[0][5], free_run[3][7]
    requests = [(p, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id])) for p in prompts]
    got, _ = _both(paged_model, requests, eos=frozenset({eos_id}))
    reasons = [events[-1][2] for events in got]
    assert "stop" in reasons and "length" in reasons
    assert any(len(events) < 12 for events in got)


def test_sampling_n_and_ineligible_rows_mixed(paged_model):
    """Seeded sampling and n > 1 run async; logprobs, penalties and min_tokens bans force
    synchronous steps while such a row is running; the outputs never change."""
    vocab = paged_model.config.vocab_size
    p = _prompts(6, vocab, seed=2)
    requests = [
        (p[0], SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True)),
        (p[1], SamplingParams(max_tokens=8, temperature=0.0, n=3, ignore_eos=True)),
        (p[2], SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)),
        (p[3], SamplingParams(max_tokens=9, temperature=0.0, presence_penalty=1.5, ignore_eos=True)),
        (p[4], SamplingParams(max_tokens=14, temperature=0.0, min_tokens=8)),
        (p[5], SamplingParams(max_tokens=20, temperature=0.8, top_k=5, seed=3, ignore_eos=True)),
    ]
    _both(paged_model, requests, eos=frozenset({5}))


def test_prefix_cache_entries_equal_after_async_steps(paged_model):
    """Blocks are registered only once their tokens are known: a follow-up request over the
    first one's whole transcript finds as many cached tokens, with the same output."""
    vocab = paged_model.config.vocab_size
    prompt = _prompts(1, vocab, seed=3)[0]
    results = []
    for async_scheduling in (False, True):
        engine = make_engine(paged_model, async_scheduling=async_scheduling)
        first = greedy_outputs(engine, [prompt], [21])[0]
        follow = prompt + first + [9, 10]
        ids = engine.add_request(follow, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        events = []
        while engine.has_work():
            events += [e for e in engine.step() if e.request_id == ids]
        results.append((first, [e.token_id for e in events], events[0].cached_tokens))
    assert results[0] == results[1]
    assert results[1][2] >= 32  # most of the transcript came from the cache


def test_abort_and_arrivals_while_a_step_is_in_flight(paged_model, tiny_model):
    vocab = paged_model.config.vocab_size
    prompts = _prompts(6, vocab, seed=4)
    engine = make_engine(paged_model, async_scheduling=True)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, greedy) for p in prompts[:4]]
    out: dict[int, list[int]] = {}
    late: list[int] = []
    for step in range(400):
        if not engine.has_work():
            break
        if step == 6:
            assert engine.overlap.in_flight is not None  # the pipeline is running
            engine.abort_request(ids[1])
            late = [engine.add_request(p, greedy) for p in prompts[4:]]
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev.token_id)
    assert engine.async_steps > 0 and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    for request_id, prompt in zip(ids + late, prompts):
        if request_id == ids[1]:
            assert len(out.get(request_id, [])) < 16
            continue
        assert out[request_id] == reference_greedy(tiny_model, prompt, 16)


def test_preemption_drains_the_pipeline_and_keeps_the_output(paged_model):
    vocab = paged_model.config.vocab_size
    prompts = _prompts(10, vocab, seed=5)
    requests = [(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for p in prompts]
    reference = _run(make_engine(paged_model), requests)
    tight = make_engine(paged_model, num_blocks=40, async_scheduling=True)
    preempted = record_preemptions(tight)
    assert _run(tight, requests) == reference
    assert preempted and tight.async_steps > 0
