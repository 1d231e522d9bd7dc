"""Speculative decoding (ngram) in the engine, on the tiny random model in float32: the
same tokens as without it, greedy and seeded, whatever the batch, and it proposes and
accepts on repetitive text; its limits (max_tokens, the window, stops) hold."""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.engines import (
    greedy,
    make_engine,
    prompt_ids,
    record_preemptions,
    run_to_completion,
    tokens_by_choice,
)
from workers.contract.sampling_params import SamplingParams, ThinkingBudget
from workers.core.limits import SpeculativeLimits
from workers.core.sequence import FinishReason
from workers.speculative.ngram_proposer import NgramProposer

NGRAM = SpeculativeLimits(num_tokens=4, lookup_min=1, lookup_max=3, disable_by_batch_size=None)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    """16 prompts of mixed lengths, half of them repeating a phrase (proposals find matches)."""
    plain = prompt_ids(tiny_tokenizer)
    phrase = tiny_tokenizer.encode("the cat sat on the mat and then ")
    repeated = [phrase * k + plain[k % len(plain)] for k in range(1, 5)]
    out = (plain + repeated) * 4
    return [p[:96] for p in out[:16]]


def _outputs(model, prompts, params, speculative, **limits):
    engine = make_engine(model, num_blocks=1200, speculative=speculative, **limits)
    ids = [engine.add_request(p, params) for p in prompts]
    events = run_to_completion(engine)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return [[e.token_id for e in events[i]] for i in ids], [[e.finish_reason for e in events[i]] for i in ids], engine


@pytest.mark.parametrize("limits", [dict(block_size=4), dict(block_size=1, max_num_batched_tokens=8),
                                    dict(block_size=16, max_num_seqs=3)], ids=["roomy", "tight", "3seqs"])
def test_greedy_tokens_equal_without_speculation(paged_model, prompts, limits):
    plain, reasons, _ = _outputs(paged_model, prompts, greedy(24), None, **limits)
    spec, spec_reasons, engine = _outputs(paged_model, prompts, greedy(24), NGRAM, **limits)
    assert spec == plain
    assert spec_reasons == reasons
    counts = engine.proposer.counts
    assert counts.accepted_tokens > 0 and counts.draft_tokens > counts.accepted_tokens


def test_suffix_proposes_from_earlier_answers_and_keeps_greedy_tokens(paged_model, prompts):
    """A second wave of the same prompts: the random model's answers rarely repeat their
    prompt, but they repeat the first wave's answers, which method suffix proposes from."""
    plain, reasons, _ = _outputs(paged_model, prompts, greedy(24), None)
    suffix = SpeculativeLimits(num_tokens=4, lookup_min=1, lookup_max=3, disable_by_batch_size=None,
                               method="suffix", history_requests=64)
    engine = make_engine(paged_model, num_blocks=1200, speculative=suffix)
    for wave in range(2):
        before = dataclasses.replace(engine.proposer.counts)
        ids = [engine.add_request(p, greedy(24)) for p in prompts]
        events = run_to_completion(engine)
        assert [[e.token_id for e in events[i]] for i in ids] == plain
        assert [[e.finish_reason for e in events[i]] for i in ids] == reasons
        taken = engine.proposer.counts.accepted_tokens - before.accepted_tokens
    assert len(engine.proposer.history) == 2 * len(prompts)
    assert taken > len(prompts) * 24 // 2  # the second wave replays the first's answers
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("penalty", [dict(presence_penalty=0.8), dict(frequency_penalty=0.5),
                                     dict(repetition_penalty=1.3)], ids=["presence", "frequency", "repetition"])
def test_penalties_count_the_proposals_before_each_row(paged_model, prompts, penalty):
    """Each verification row is penalised for the proposals before it, as if they had been
    sampled: greedy and seeded tokens equal the plain engine's, with proposals taken."""
    runs = [greedy(24, **penalty), SamplingParams(max_tokens=24, temperature=0.9, seed=5, **penalty)]
    for params in runs:
        plain, _, _ = _outputs(paged_model, prompts, params, None)
        engine = make_engine(paged_model, num_blocks=1200, speculative=NGRAM)
        engine.proposer = engine.scheduler.proposer = ScriptedProposer(NGRAM, {tuple(p): t + [0] for p, t in
                                                                               zip(prompts, plain)})
        ids = [engine.add_request(p, params) for p in prompts]
        events = run_to_completion(engine)
        assert [[e.token_id for e in events[i]] for i in ids] == plain
        assert engine.proposer.counts.accepted_tokens > 50


def _scripted_outputs(model, prompts, params_list, **limits):
    """Each prompt with its own params: the plain engine's tokens, then the same through a
    ScriptedProposer that proposes them (every third wrong); and how many it got taken."""
    plain_engine = make_engine(model, num_blocks=1200, **limits)
    ids = [plain_engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    events = run_to_completion(plain_engine)
    plain = [[e.token_id for e in events[i]] for i in ids]
    engine = make_engine(model, num_blocks=1200, speculative=NGRAM, **limits)
    engine.proposer = engine.scheduler.proposer = ScriptedProposer(NGRAM, {tuple(p): t + [0] for p, t in
                                                                           zip(prompts, plain)})
    ids = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    events = run_to_completion(engine)
    return plain, [[e.token_id for e in events[i]] for i in ids], engine.proposer.counts.accepted_tokens


def test_min_tokens_bans_each_row_by_its_own_position(paged_model, prompts):
    """EOS pushed up by logit_bias and banned until min_tokens: a verification that spans
    min_tokens bans it in the rows before and not after, so every answer ends where the
    plain engine's does (at or after its min_tokens) and proposals are taken before it."""
    eos = 7
    params = [SamplingParams(max_tokens=24, temperature=0.0, min_tokens=3 + i % 9, logit_bias={eos: 4.0})
              for i in range(len(prompts))]
    plain, spec, taken = _scripted_outputs(paged_model, prompts, params, eos=frozenset({eos}))
    assert spec == plain
    ends = [len(t) for t in plain if t[-1] == eos]
    assert len(ends) > len(prompts) // 2 and any(n < 24 for n in ends)
    assert all(len(t) >= p.min_tokens for t, p in zip(plain, params))
    assert taken > 20


def test_a_thinking_budget_forces_its_end_where_it_does_without_proposals(paged_model, prompts):
    """Prompts that open the reasoning section, budgets of 2-10 tokens: proposals are cut
    before any row the budget would force, so the end tag comes at the same place, and the
    tokens before and after it are proposed and taken too."""
    start, end = (50,), (60, 61)
    opened = [p + list(start) for p in prompts]
    params = [greedy(24, thinking_budget=ThinkingBudget(2 + i % 9, "<think>", "</think>", start_ids=start,
                                                        end_ids=end)) for i in range(len(prompts))]
    plain, spec, taken = _scripted_outputs(paged_model, opened, params)
    assert spec == plain
    for tokens, p in zip(plain, params):
        n = p.thinking_budget.tokens
        assert tokens[n : n + 2] == list(end)
    assert taken > 50
    # The prompt-lookup proposer itself proposes for such requests (a budget and min_tokens).
    both = dataclasses.replace(params[4], min_tokens=8)
    plain, _, _ = _outputs(paged_model, opened, both, None)
    spec, _, engine = _outputs(paged_model, opened, both, NGRAM)
    assert spec == plain and engine.proposer.counts.accepted_tokens > 0


class ScriptedProposer(NgramProposer):
    """Proposes each prompt's known greedy answer, every third token of it wrong: most
    proposals are taken, many refused part way (the random model's ngram proposals are
    rarely right, which would leave the taking path little tested)."""

    def __init__(self, limits: SpeculativeLimits, answers: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__(limits)
        self.answers = answers

    def propose(self, seq, room: int) -> tuple[int, ...]:
        answer = self.answers[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        done = seq.num_output_tokens
        draft = answer[done : done + min(room, self.limits.num_tokens)]
        return tuple(t + 1 if (done + j) % 3 == 2 else t for j, t in enumerate(draft))


@pytest.mark.parametrize("limits", [dict(block_size=4), dict(block_size=1, max_num_batched_tokens=8),
                                    dict(block_size=4, max_num_seqs=16, num_blocks=150)],
                         ids=["roomy", "tight", "preempting"])
def test_many_proposals_taken_and_refused(paged_model, prompts, limits):
    num_blocks = limits.pop("num_blocks", 1200)
    plain, reasons, _ = _outputs(paged_model, prompts, greedy(24), None, **limits)
    engine = make_engine(paged_model, num_blocks=num_blocks, speculative=NGRAM, **limits)
    engine.proposer = engine.scheduler.proposer = ScriptedProposer(NGRAM, {tuple(p): t + [0] for p, t in
                                                                           zip(prompts, plain)})
    preempted = record_preemptions(engine)
    ids = [engine.add_request(p, greedy(24)) for p in prompts]
    events = run_to_completion(engine)
    assert bool(preempted) == (num_blocks < 1200)
    assert [[e.token_id for e in events[i]] for i in ids] == plain
    assert [[e.finish_reason for e in events[i]] for i in ids] == reasons
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    counts = engine.proposer.counts
    assert counts.accepted_tokens > 100 and counts.draft_tokens - counts.accepted_tokens > 30


def test_seeded_sampling_gives_the_same_tokens(paged_model, prompts):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=7)
    plain, _, _ = _outputs(paged_model, prompts, params, None)
    spec, _, engine = _outputs(paged_model, prompts, params, NGRAM)
    assert spec == plain
    assert engine.proposer.counts.drafts > 0


def test_max_tokens_holds(paged_model, prompts):
    """Proposals never run past max_tokens."""
    for n in (1, 2, 5, 9):
        plain, reasons, _ = _outputs(paged_model, prompts[:6], greedy(n), None)
        spec, spec_reasons, _ = _outputs(paged_model, prompts[:6], greedy(n), NGRAM)
        assert spec == plain and all(len(t) == n for t in spec)
        assert spec_reasons == reasons


def test_a_stop_token_inside_accepted_proposals_ends_there(paged_model, prompts):
    plain, _, _ = _outputs(paged_model, prompts, greedy(24), None)
    # A token each repetitive output produces late: with it as a stop token, the output ends
    # at its first occurrence, whether that came as a proposal or not.
    stop = plain[8][10]
    params = greedy(24, stop_token_ids=[stop])
    expected = [t[: t.index(stop) + 1] if stop in t else t for t in plain]
    spec, reasons, _ = _outputs(paged_model, prompts, params, NGRAM)
    assert spec == expected
    assert all(r[-1] is FinishReason.STOP for t, r in zip(spec, reasons) if stop in t)


def test_logprobs_of_accepted_tokens(paged_model, prompts):
    params = greedy(16, logprobs=2)
    engine_plain = make_engine(paged_model, num_blocks=1200)
    engine_spec = make_engine(paged_model, num_blocks=1200, speculative=NGRAM)
    for prompt in prompts[8:12]:
        a = run_to_completion_one(engine_plain, prompt, params)
        b = run_to_completion_one(engine_spec, prompt, params)
        assert [e.token_id for e in a] == [e.token_id for e in b]
        assert [e.logprob for e in a] == pytest.approx([e.logprob for e in b], abs=1e-4)
        assert [[t for t, _ in e.top_logprobs] for e in a] == [[t for t, _ in e.top_logprobs] for e in b]
    assert engine_spec.proposer.counts.accepted_tokens > 0


def run_to_completion_one(engine, prompt, params):
    request = engine.add_request(prompt, params)
    return run_to_completion(engine)[request]


def test_disable_by_batch_size(paged_model, prompts):
    limits = SpeculativeLimits(num_tokens=4, lookup_min=1, lookup_max=3, disable_by_batch_size=2)
    _, _, engine = _outputs(paged_model, prompts[8:12], greedy(24), limits)
    alone, _, engine_alone = _outputs(paged_model, prompts[8:9], greedy(24), limits)
    assert engine.proposer.counts.drafts < engine_alone.proposer.counts.drafts * 4
    assert engine_alone.proposer.counts.drafts > 0


def test_n_choices_and_prefix_cache_hits(paged_model, prompts):
    """n=2 seeded choices each speculate after the fork; a second round finds the prompts'
    blocks cached (and proposals' K/V never poison the cache): the same tokens throughout."""
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=11, n=2)
    engines = {name: make_engine(paged_model, num_blocks=1200, speculative=spec)
               for name, spec in (("plain", None), ("ngram", NGRAM))}
    outputs = {}
    for name, engine in engines.items():
        rounds = []
        for _ in range(2):
            ids = [engine.add_request(p, params) for p in prompts[6:12]]
            events = run_to_completion(engine)
            rounds.append([tokens_by_choice(events[i]) for i in ids])
        assert rounds[0] == rounds[1]
        outputs[name] = rounds[0]
    assert outputs["ngram"] == outputs["plain"]
    assert engines["ngram"].blocks.hit_tokens > 0 and engines["ngram"].proposer.counts.drafts > 0


@pytest.mark.parametrize("params", [greedy(20), SamplingParams(max_tokens=20, temperature=0.8, seed=5)],
                         ids=["greedy", "seeded"])
def test_a_resumed_request_speculates_to_the_same_tokens(paged_model, prompts, params):
    """Resumed from its first k tokens on an engine that speculates, a request gives the
    rest of its uninterrupted run; and where that engine caches the whole resumed prefix
    (as a PD decode replica does after a hand-over), so that its first step feeds one
    token, that step proposes nothing: its first new token's event carries the
    first-token facts (queue time, cached tokens)."""
    prompt = prompts[8]
    reference, _, _ = _outputs(paged_model, [prompt], params, None)
    engine = make_engine(paged_model, num_blocks=1200, speculative=NGRAM)
    engine.add_request(prompt, params)
    run_to_completion(engine)  # the whole run's blocks now cached
    aligned = [k for k in range(1, 19) if (len(prompt) + k) % 4 == 0]  # block_size 4: all but the last token cached
    for k in [1, *aligned]:
        choices = engine.replay_output(prompt, params, {0: reference[0][:k]}, None)
        request = engine.add_request(prompt, params, resume=choices)
        events = run_to_completion(engine)[request]
        assert [e.token_id for e in events] == reference[0][k:], k
        assert events[0].queue_time is not None and events[0].cached_tokens is not None, k
        assert all(e.queue_time is None for e in events[1:])
