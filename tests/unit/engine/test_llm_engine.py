"""LLMEngine end to end on the tiny model: batched greedy == transformers generate,
preemption, abort, finish reasons, capacity checks, a failed step contained to its
request, and the prefix cache."""

from __future__ import annotations

import pytest

from tests.support.engines import (
    greedy,
    make_engine,
    prompt_ids,
    record_preemptions,
    reference_greedy,
    run_to_completion,
    template_ids,
)
from workers.contract.sampling_params import SamplingParams
from workers.core.limits import CapacityError
from workers.core.sequence import FinishReason
from workers.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return prompt_ids(tiny_tokenizer)


@pytest.mark.parametrize(
    "limits",
    [
        dict(block_size=4),
        dict(block_size=4, max_num_batched_tokens=8),  # prompts chunked over steps
        dict(block_size=16, max_num_batched_tokens=5, max_num_seqs=2),
        dict(block_size=1, max_num_batched_tokens=3),
    ],
    ids=["roomy", "chunked", "chunked-2seqs", "block1"],
)
def test_batched_greedy_equals_generate(tiny_model, paged_model, prompts, limits):
    engine = make_engine(paged_model, num_blocks=400 // limits["block_size"] * 4, **limits)
    ids = [engine.add_request(p, greedy(10)) for p in prompts]
    events = run_to_completion(engine)
    for seq_id, prompt in zip(ids, prompts):
        tokens = [e.token_id for e in events[seq_id]]
        assert tokens == reference_greedy(tiny_model, prompt, 10)
        assert [e.finish_reason for e in events[seq_id]] == [None] * 9 + [FinishReason.LENGTH]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.num_active == 0


def test_request_added_mid_generation_joins_the_batch(tiny_model, paged_model, prompts):
    engine = make_engine(paged_model, max_num_batched_tokens=6)
    first = engine.add_request(prompts[2], greedy(12))
    events: dict[int, list[int]] = {}
    for _ in range(5):
        for ev in engine.step():
            events.setdefault(ev.request_id, []).append(ev.token_id)
    second = engine.add_request(prompts[4], greedy(12))
    for seq_id, evs in run_to_completion(engine).items():
        events.setdefault(seq_id, []).extend(e.token_id for e in evs)
    assert events[first] == reference_greedy(tiny_model, prompts[2], 12)
    assert events[second] == reference_greedy(tiny_model, prompts[4], 12)


def test_preemption_recomputes_same_greedy_tokens(tiny_model, paged_model, prompts):
    max_tokens = 12
    longest = max(len(p) for p in prompts) + max_tokens
    num_blocks = -(-longest // 4) + 1  # enough for one sequence at a time, not for all
    small = make_engine(paged_model, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16)
    preempted = record_preemptions(small)
    ids = [small.add_request(p, greedy(max_tokens)) for p in prompts]
    events = run_to_completion(small)
    assert len(preempted) > 0, "the pool was meant to force preemption"

    large = make_engine(paged_model, num_blocks=256)
    large_ids = [large.add_request(p, greedy(max_tokens)) for p in prompts]
    large_events = run_to_completion(large)
    for seq_id, large_id, prompt in zip(ids, large_ids, prompts):
        tokens = [e.token_id for e in events[seq_id]]
        assert tokens == [e.token_id for e in large_events[large_id]]
        assert tokens == reference_greedy(tiny_model, prompt, max_tokens)
    assert small.blocks.num_free_blocks == num_blocks


def test_seeded_sampling_independent_of_batch_and_preemption(paged_model, prompts):
    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=1.5, top_p=0.95, seed=seed, ignore_eos=True)

    alone = make_engine(paged_model, num_blocks=256)
    alone_id = alone.add_request(prompts[2], seeded(7))
    alone_tokens = [e.token_id for e in run_to_completion(alone)[alone_id]]

    # Same request in a crowded, preempting engine, with unseeded neighbours.
    longest = max(len(p) for p in prompts) + 12
    crowded = make_engine(paged_model, num_blocks=-(-longest // 4) + 1, max_num_batched_tokens=16)
    preempted = record_preemptions(crowded)
    ids = [crowded.add_request(p, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)) for p in prompts]
    seeded_id = crowded.add_request(prompts[2], seeded(7))
    other_seed = crowded.add_request(prompts[2], seeded(8))
    events = run_to_completion(crowded)
    assert preempted
    assert set(events) == set(ids) | {seeded_id, other_seed}
    assert [e.token_id for e in events[seeded_id]] == alone_tokens
    assert [e.token_id for e in events[other_seed]] != alone_tokens


def test_abort_mid_generation_frees_all_blocks(paged_model, prompts):
    engine = make_engine(paged_model, num_blocks=64)
    ids = [engine.add_request(p, greedy(50)) for p in prompts]
    for _ in range(4):
        engine.step()
    assert engine.blocks.num_used_blocks > 0
    engine.abort_request(ids[0])
    engine.abort_request(ids[3])
    engine.abort_request(12345)  # unknown ids are ignored
    assert engine.num_active == len(prompts) - 2
    seen = set()
    for _ in range(3):
        seen |= {ev.request_id for ev in engine.step()}
    assert ids[0] not in seen and ids[3] not in seen
    assert {ids[1], ids[2], ids[4]} <= seen
    for seq_id in ids:
        engine.abort_request(seq_id)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.has_work() and engine.num_active == 0
    assert engine.step() == []


def test_abort_of_waiting_request(paged_model, prompts):
    engine = make_engine(paged_model, num_blocks=64, max_num_seqs=1)
    a = engine.add_request(prompts[1], greedy(20))
    b = engine.add_request(prompts[2], greedy(20))
    engine.step()
    engine.abort_request(b)  # never ran
    events = run_to_completion(engine)
    assert set(events) == {a}
    assert engine.blocks.num_free_blocks == 64


def test_max_tokens_finishes_with_length(paged_model, prompts):
    engine = make_engine(paged_model)
    seq_id = engine.add_request(prompts[1], greedy(3))
    evs = run_to_completion(engine)[seq_id]
    assert len(evs) == 3
    assert evs[-1].finish_reason is FinishReason.LENGTH and evs[-1].finish_reason.value == "length"


def test_eos_finishes_with_stop(tiny_model, paged_model, prompts):
    ref = reference_greedy(tiny_model, prompts[1], 10)
    eos = ref[3]
    cut = ref.index(eos)  # first occurrence
    engine = make_engine(paged_model, eos=frozenset({eos}))
    seq_id = engine.add_request(prompts[1], SamplingParams(max_tokens=10, temperature=0.0))
    ignoring = engine.add_request(prompts[1], greedy(10))  # ignore_eos=True
    events = run_to_completion(engine)
    evs = events[seq_id]
    assert [e.token_id for e in evs] == ref[: cut + 1]
    assert evs[-1].finish_reason is FinishReason.STOP and evs[-1].finish_reason.value == "stop"
    assert evs[-1].stop_token_id is None  # EOS, not a requested stop token
    assert [e.token_id for e in events[ignoring]] == ref


def test_stop_token_ids_finish_with_stop(tiny_model, paged_model, prompts):
    ref = reference_greedy(tiny_model, prompts[2], 10)
    stop = ref[2]
    cut = ref.index(stop)
    engine = make_engine(paged_model)
    seq_id = engine.add_request(prompts[2], greedy(10, stop_token_ids=(stop,)))
    evs = run_to_completion(engine)[seq_id]
    assert [e.token_id for e in evs] == ref[: cut + 1]
    assert evs[-1].finish_reason is FinishReason.STOP
    assert evs[-1].stop_token_id == stop


def test_context_window_cap_raises_capacity_error(paged_model):
    engine = make_engine(paged_model, num_blocks=64, max_model_len=32)
    prompt = list(range(5, 25))  # 20 tokens
    engine.add_request(prompt, greedy(12))  # exactly 32: fits
    with pytest.raises(CapacityError, match="maximum context length is 32"):
        engine.add_request(prompt, greedy(13))
    with pytest.raises(CapacityError):
        engine.add_request(list(range(5, 40)), greedy(1))
    assert engine.num_active == 1


def test_request_larger_than_kv_pool_raises_capacity_error(paged_model):
    engine = make_engine(paged_model, num_blocks=4, block_size=4)  # 16 token slots
    engine.add_request(list(range(5, 15)), greedy(6))
    with pytest.raises(CapacityError, match="KV cache"):
        engine.add_request(list(range(5, 15)), greedy(7))


def test_an_exception_in_one_requests_sampling_fails_that_request_only(paged_model, tiny_tokenizer):
    """The step is undone and its requests re-run one at a time: only the poisoned one fails,
    the others finish with exactly the tokens they get without it."""
    prompts = [template_ids(tiny_tokenizer, t) for t in ("Hello there", "Paris is", "def add(a, b):")]
    clean = make_engine(paged_model)
    ids = [clean.add_request(p, greedy(8)) for p in prompts]
    expected = run_to_completion(clean)

    engine = make_engine(paged_model)
    sampler = engine.sampler
    poison_seed = 666

    def poisoned_sampler(logits, tensors):
        if tensors.seeded is not None:  # the (only) seeded request is in this step
            raise RuntimeError("injected sampling failure")
        return sampler(logits, tensors)

    engine.sampler = poisoned_sampler
    good = [engine.add_request(p, greedy(8)) for p in prompts]
    bad = engine.add_request(prompts[0], SamplingParams(max_tokens=8, temperature=1.0, seed=poison_seed))
    events = run_to_completion(engine)
    assert [e.error is not None for e in events[bad]] == [True]
    assert events[bad][0].request_finished
    for rid, ref in zip(good, ids):
        assert [e.token_id for e in events[rid]] == [e.token_id for e in expected[ref]]
    assert engine.blocks.num_used_blocks == 0 and engine.scheduler.only_request is None


def test_queue_time_is_reported_once_per_request(paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, max_num_seqs=1)  # the second request must wait for the first
    first = engine.add_request(template_ids(tiny_tokenizer, "Hi"), greedy(6))
    second = engine.add_request(template_ids(tiny_tokenizer, "Hello"), greedy(2))
    events = run_to_completion(engine)
    for rid in (first, second):
        assert events[rid][0].queue_time is not None and events[rid][0].queue_time >= 0
        assert all(e.queue_time is None for e in events[rid][1:])
    assert events[second][0].queue_time > events[first][0].queue_time  # waited for six steps


def test_stats_and_describe_say_what_the_engine_holds(paged_model, prompts):
    engine = make_engine(paged_model, num_blocks=64, block_size=4, max_num_seqs=2, max_model_len=96)
    described = engine.describe()
    assert (described.max_model_len, described.block_size, described.num_blocks) == (96, 4, 64)
    assert described.vocab_size == paged_model.get_output_embeddings().weight.shape[0]
    assert (described.dtype, described.decode_attention, described.cuda_graph_max_batch) == ("float32", "cpu", 0)
    for p in prompts[:3]:
        engine.add_request(p, greedy(4))
    queued = engine.stats()
    assert (queued.active_requests, queued.waiting, queued.running, queued.kv_blocks_used) == (3, 3, 0, 0)
    engine.step()
    stepped = engine.stats()
    assert (stepped.active_requests, stepped.waiting, stepped.running) == (3, 1, 2)
    assert stepped.kv_blocks_used == engine.blocks.num_used_blocks > 0 and stepped.kv_blocks_total == 64
    assert stepped.prefix_cache_query_tokens > 0
    run_to_completion(engine)
    done = engine.stats()
    assert (done.active_requests, done.waiting, done.running, done.kv_blocks_used) == (0, 0, 0, 0)


def test_stats_count_the_prompt_tokens_not_yet_prefilled(paged_model, prompts):
    engine = make_engine(paged_model, num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=8,
                         enable_prefix_caching=False)
    long, short = prompts[4], prompts[0]
    assert len(long) > 16
    engine.add_request(long, greedy(2))
    engine.add_request(short, greedy(2))
    assert engine.stats().queued_prompt_tokens == len(long) + len(short)
    engine.step()  # the first 8-token chunk of the long prompt; the short one waits (max_num_seqs=1)
    assert engine.stats().queued_prompt_tokens == len(long) - 8 + len(short)
    for _ in range(-(-len(long) // 8) - 1):  # the rest of its chunks: it has sampled its first token
        engine.step()
    decoding = engine.stats()
    assert (decoding.running, decoding.waiting, decoding.queued_prompt_tokens) == (1, 1, len(short))
    run_to_completion(engine)
    assert engine.stats().queued_prompt_tokens == 0


# --- prefix cache -------------------------------------------------------------------------


def count_fed_tokens(engine: LLMEngine) -> list[int]:
    """Tokens fed to the model, one entry per forward call (a pre-hook on the model)."""
    fed: list[int] = []

    def hook(module, args, kwargs):
        fed.append(kwargs["input_ids"].shape[-1])

    engine.runner.model.register_forward_pre_hook(hook, with_kwargs=True)
    return fed


def shared_prefix_prompts(tiny_tokenizer) -> tuple[list[int], list[list[int]]]:
    system = tiny_tokenizer("You are a helpful assistant. " * 4)["input_ids"]
    questions = ["Paris is the capital of", "def add(a, b):", "The quick brown fox", "Hello! How can I"]
    return system, [system + tiny_tokenizer(q)["input_ids"] for q in questions]


def run_in_waves(engine: LLMEngine, waves: list[list[tuple[list[int], SamplingParams]]]) -> list[list]:
    """Each wave is added after the previous one finished (so later waves can hit the cache)."""
    out = []
    for wave in waves:
        ids = [engine.add_request(p, params) for p, params in wave]
        events = run_to_completion(engine)
        out.extend(events[i] for i in ids)
    return out


def test_outputs_identical_with_prefix_cache_on_and_off(paged_model, tiny_tokenizer):
    system, prompts = shared_prefix_prompts(tiny_tokenizer)
    whole_blocks = prompts[2][: len(prompts[2]) // 4 * 4]  # a prompt that ends on a block boundary
    seeded_n = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True)
    waves = [
        [(prompts[0], greedy(8)), (whole_blocks, greedy(8))],
        [(prompts[1], greedy(8)), (prompts[2], seeded_n)],  # n > 1 forks after a cache hit
        [(prompts[0], greedy(8)), (whole_blocks, greedy(8)), (prompts[3], greedy(8, logprobs=2)),
         (prompts[1], greedy(8, prompt_logprobs=2))],
    ]
    results = {}
    for enabled in (False, True):
        engine = make_engine(paged_model, num_blocks=128, enable_prefix_caching=enabled)
        results[enabled] = run_in_waves(engine, waves)
        assert engine.blocks.num_used_blocks == 0
    for off, on in zip(results[False], results[True]):
        assert [(e.index, e.token_id) for e in off] == [(e.index, e.token_id) for e in on]
        assert [e.logprob for e in off] == pytest.approx([e.logprob for e in on], abs=1e-4)
        assert off[0].cached_tokens == 0
    cached = [evs[0].cached_tokens for evs in results[True]]
    shared = len(system) // 4 * 4
    assert cached[:2] == [0, 0]
    assert cached[2] >= shared and cached[3] >= shared  # the shared system prompt, whole blocks
    # the same prompt again: every token but the last (its logits are needed), the last
    # block's taken as a tail of the earlier request's
    assert cached[4] == len(prompts[0]) - 1
    assert cached[5] == len(whole_blocks) - 1
    assert cached[6] >= shared
    assert cached[7] == 0  # prompt_logprobs skips the cache
    prompt_lp = {on: results[on][7][0].prompt_logprobs for on in (False, True)}
    assert len(prompt_lp[True]) == len(prompts[1]) - 1
    assert [t for t, *_ in prompt_lp[True]] == [t for t, *_ in prompt_lp[False]]


def test_second_request_with_shared_prefix_feeds_fewer_tokens(paged_model, tiny_tokenizer):
    system, prompts = shared_prefix_prompts(tiny_tokenizer)
    fed_per_request = {}
    for enabled in (False, True):
        engine = make_engine(paged_model, num_blocks=128, enable_prefix_caching=enabled)
        run_in_waves(engine, [[(prompts[0], greedy(1))]])
        fed = count_fed_tokens(engine)
        (events,) = run_in_waves(engine, [[(prompts[1], greedy(1))]])
        fed_per_request[enabled] = sum(fed)
        assert events[0].cached_tokens == (len(system) // 4 * 4 if enabled else 0)
    assert fed_per_request[False] == len(prompts[1])
    assert fed_per_request[True] == len(prompts[1]) - len(system) // 4 * 4


def test_preemption_resumes_from_the_cache_with_identical_greedy_output(tiny_model, paged_model, prompts):
    max_tokens = 12
    longest = max(len(p) for p in prompts) + max_tokens
    engine = make_engine(paged_model, num_blocks=-(-longest // 4) + 2, block_size=4, max_num_batched_tokens=16)
    resumed_at: list[int] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        resumed_at.extend(c.seq.num_computed_tokens for c in batch.prefills if c.seq.num_output_tokens > 0)
        return batch

    engine.scheduler.schedule = recording_schedule
    ids = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
    events = run_to_completion(engine)
    assert resumed_at and max(resumed_at) > 0, "a preempted sequence should resume from its cached blocks"
    for rid, prompt in zip(ids, prompts):
        assert [e.token_id for e in events[rid]] == reference_greedy(tiny_model, prompt, max_tokens)
    assert engine.blocks.num_used_blocks == 0


def test_beam_search_with_a_cached_prefix_matches_no_cache(paged_model, tiny_tokenizer):
    _, prompts = shared_prefix_prompts(tiny_tokenizer)
    beams = SamplingParams(max_tokens=6, n=2, use_beam_search=True, best_of=3, ignore_eos=True, temperature=0.0)
    results = {}
    for enabled in (False, True):
        engine = make_engine(paged_model, num_blocks=128, enable_prefix_caching=enabled)
        results[enabled] = run_in_waves(engine, [[(prompts[0], greedy(4))], [(prompts[2], beams)]])[1]
    assert [e.beam_token_ids for e in results[True]] == [e.beam_token_ids for e in results[False]]
    assert results[True][0].cached_tokens > 0


def test_a_failed_step_leaves_the_prefix_cache_consistent(paged_model, tiny_tokenizer):
    """Blocks are registered only after the forward pass wrote them: after a step fails and
    is re-run request by request, later requests that hit those blocks get the clean output."""
    _, prompts = shared_prefix_prompts(tiny_tokenizer)
    clean = make_engine(paged_model, num_blocks=128, enable_prefix_caching=False)
    expected = [[e.token_id for e in evs] for evs in run_in_waves(clean, [[(p, greedy(6)) for p in prompts]])]

    engine = make_engine(paged_model, num_blocks=128)
    forward = engine.runner.forward

    def poisoned_forward(decodes, prefills):  # fails before any K/V is written
        if any(c.seq.params.seed is not None for c in decodes + prefills):
            raise RuntimeError("injected model failure")
        return forward(decodes, prefills)

    engine.runner.forward = poisoned_forward
    good = [engine.add_request(p, greedy(6)) for p in prompts[:2]]
    bad = engine.add_request(prompts[2], SamplingParams(max_tokens=6, temperature=1.0, seed=1))
    events = run_to_completion(engine)
    assert events[bad][0].error is not None
    assert [[e.token_id for e in events[r]] for r in good] == expected[:2]
    again = run_in_waves(engine, [[(p, greedy(6)) for p in prompts]])
    assert [evs[0].cached_tokens > 0 for evs in again] == [True] * 4
    assert [[e.token_id for e in evs] for evs in again] == expected
    assert engine.blocks.num_used_blocks == 0
