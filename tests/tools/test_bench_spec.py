"""tools.bench.spec on the tiny model: off and on run the same load in turn, and the
speculative rows carry their acceptance figures from that engine's counters."""

from __future__ import annotations

from tests.support.engines import make_engine, prompt_ids, run_to_completion
from tools.bench.spec import lookup_ceiling, measure, paced_replay
from workers.contract.sampling_params import SamplingParams
from workers.core.limits import SpeculativeLimits


def _accepted(model, prompt: list[int], limits: SpeculativeLimits) -> int:
    engine = make_engine(model, num_blocks=600, speculative=limits)
    engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    run_to_completion(engine)
    return engine.proposer.counts.accepted_tokens


def test_levels_off_and_on_with_acceptance(paged_model, tiny_tokenizer):
    limits = SpeculativeLimits(num_tokens=4, lookup_min=1, lookup_max=3, disable_by_batch_size=None)
    engines = {False: make_engine(paged_model, num_blocks=600), True: make_engine(paged_model, num_blocks=600,
                                                                                   speculative=limits)}
    plain = prompt_ids(tiny_tokenizer)
    prompt = (tiny_tokenizer.encode("the cat sat on the mat and then ") * 4 + plain[4 % len(plain)])[:96]
    assert _accepted(paged_model, prompt, limits) > 0  # the random model's answer repeats a little of it
    levels = measure(engines, {"edit": (prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))},
                     [1, 2], rounds=1)
    assert [(x.concurrency, x.speculative) for x in levels] == [(1, False), (1, True), (2, False), (2, True)]
    assert all(x.output_tok_s > 0 for x in levels)
    spec = [x for x in levels if x.speculative]
    assert all(0 < x.accepted_per_draft_token <= 1 and x.tokens_per_verification > 1 for x in spec)
    assert all(x.accepted_per_draft_token == 0 for x in levels if not x.speculative)


def test_lookup_ceiling_counts_the_steps_prompt_lookup_would_take():
    """A verbatim copy of the prompt goes k+1 tokens a step once lookup finds it; an answer
    with nothing of the prompt in it goes one token a step."""
    prompt = list(range(100, 140))
    copy = prompt[:33]
    # Step 1 (prefill) gives copy[0]; lookup needs 2 tokens, so step 2 gives copy[1]; from
    # then on each step takes 4 proposals + its own token: 31 tokens in 7 more steps.
    assert lookup_ceiling(prompt, copy, 4, 2, 4) == 33 / 9
    assert lookup_ceiling(prompt, list(range(500, 520)), 4, 2, 4) == 1.0
    assert lookup_ceiling(prompt, [], 4, 2, 4) == 0.0


def test_paced_replay_prices_each_proposed_token():
    """At no price the pacing always proposes the most, which is the ceiling; at 0.3 a verbatim
    copy still gets 4 proposals a step (the prior rate 0.8: 0.8^4 > 0.3), each step of 5
    tokens costing 2.2 plain steps; an answer that lookup never finds costs nothing extra."""
    prompt = list(range(100, 140))
    copy = prompt[:33]
    assert paced_replay(prompt, copy, 4, 2, 4, 0.0) == lookup_ceiling(prompt, copy, 4, 2, 4)
    # Steps: the prefill's token, one without a match, six of 4 + 1 at 2.2 each, and the last
    # token with one proposal (room for one) at 1.3: 33 tokens for 16.5 plain steps.
    assert paced_replay(prompt, copy, 4, 2, 4, 0.3) == 33 / 16.5
    assert paced_replay(prompt, list(range(500, 520)), 4, 2, 4, 0.3) == 1.0
