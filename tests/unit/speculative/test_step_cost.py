"""The measured price of a proposed token (proposals.StepCost): a line through the engine's
recent step timings by rows, as a share of a step's time per running sequence."""

from __future__ import annotations

import pytest

from tests.support.engines import make_engine, run_to_completion
from workers.contract.sampling_params import SamplingParams
from workers.core.limits import SpeculativeLimits
from workers.speculative.proposals import ROW_COST, SHARE_RANGE, StepCost


def _feed(cost: StepCost, fixed: float, per_row: float, rows: list[int], times: int = 1) -> None:
    for _ in range(times):
        for n in rows:
            cost.record(n, fixed + per_row * n)


def test_the_prior_until_rows_vary():
    cost = StepCost()
    assert cost.share(1) == ROW_COST
    _feed(cost, 0.002, 0.006, [1], times=50)  # one row a step: no slope to see
    assert cost.share(1) == ROW_COST


def test_a_line_through_the_timings():
    """a = 2 ms a step, b = 6 ms a row: one sequence's proposal costs b / (a + b) = 0.75 of
    its step; with 16 sequences, b / ((a + 16 b) / 16) = 0.98."""
    cost = StepCost()
    _feed(cost, 0.002, 0.006, [1, 2, 5, 1, 3, 1], times=5)
    assert cost.share(1) == pytest.approx(0.75)
    assert cost.share(16) == pytest.approx(0.006 * 16 / (0.002 + 0.096))


def test_recent_steps_outweigh_old_ones():
    """The machine gets busier (a row costs 3x): within ~100 steps the price follows."""
    cost = StepCost()
    _feed(cost, 0.010, 0.001, [1, 4, 2], times=20)
    assert cost.share(1) == pytest.approx(1 / 11)
    _feed(cost, 0.010, 0.003, [1, 4, 2], times=40)
    assert cost.share(1) == pytest.approx(3 / 13, rel=0.02)


def test_the_share_stays_in_its_range_and_a_fixed_price_stays_fixed():
    cost = StepCost()
    _feed(cost, 0.0, 0.004, [1, 3], times=10)  # all cost in the rows: share 1
    assert cost.share(1) == pytest.approx(1.0)
    _feed(cost, 0.050, -0.001, [1, 3], times=200)  # timings falling with rows: a slope of 0, clamped
    assert cost.share(1) == SHARE_RANGE[0]
    fixed = StepCost(0.05, learn=False)
    _feed(fixed, 0.002, 0.006, [1, 2, 5], times=10)
    assert fixed.share(1) == 0.05


def test_the_engine_prices_proposals_by_its_own_steps(paged_model):
    """An engine with ngram proposals records its decode and verification steps: once rows
    have varied, the proposer's price is the measured one, not the prior."""
    speculative = SpeculativeLimits(num_tokens=4, lookup_min=1, lookup_max=3, disable_by_batch_size=None)
    engine = make_engine(paged_model, speculative=speculative, learn_step_cost=True)
    for prompt in ([5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10]):
        engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    run_to_completion(engine)
    cost = engine.proposer.step_cost
    assert cost.fitted and cost.share(1) != ROW_COST
