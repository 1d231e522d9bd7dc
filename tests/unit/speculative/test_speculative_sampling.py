"""Sampled (unseeded) requests keep the model's distribution under speculation: the
first three tokens of many sampled answers, with proposals both taken and refused, fit
the exact top-3 distribution the reference model gives (chi-square goodness of fit).

The proposals here are the model's own second choice (then its first), so a good share
is taken and a good share refused: the random model's ngram proposals are rarely among
its top three, which would test the refusals alone."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import torch

from tests.support.engines import make_engine, run_to_completion
from workers.contract.sampling_params import SamplingParams
from workers.core.limits import SpeculativeLimits
from workers.speculative.ngram_proposer import NgramProposer

SAMPLES = 1500
TOP_K = 3


def _top_k_probs(model, ids: list[int]) -> dict[int, float]:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    values, tokens = logits.topk(TOP_K)
    return dict(zip(tokens.tolist(), torch.softmax(values, dim=0).tolist()))


def _exact(model, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) under top-3 sampling at temperature 1."""
    out = {}
    for t1, p1 in _top_k_probs(model, prompt).items():
        for t2, p2 in _top_k_probs(model, prompt + [t1]).items():
            for t3, p3 in _top_k_probs(model, prompt + [t1, t2]).items():
                out[(t1, t2, t3)] = p1 * p2 * p3
    return out


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (Wilson-Hilferty; z: the normal's 0.999 point)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi_square(counts: Counter, exact: dict[tuple[int, ...], float]) -> float:
    return sum((counts.get(k, 0) - SAMPLES * p) ** 2 / (SAMPLES * p) for k, p in exact.items())


class RankedProposer(NgramProposer):
    """Proposes the model's second most likely next token, then the most likely after it."""

    def __init__(self, model, limits: SpeculativeLimits) -> None:
        super().__init__(limits)
        self.model = model
        self._ranked: dict[tuple[int, ...], list[int]] = {}

    def _ranking(self, ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in self._ranked:
            self._ranked[key] = list(_top_k_probs(self.model, ids))
        return self._ranked[key]

    def propose(self, seq, room: int) -> tuple[int, ...]:
        if room <= 0:
            return ()
        first = self._ranking(seq.token_ids)[1]
        return (first, self._ranking(seq.token_ids + [first])[0])[:room]


def test_sampled_tokens_keep_the_model_distribution(tiny_model, paged_model):
    prompt = list(range(3, 40))
    exact = _exact(tiny_model, prompt)
    limits = SpeculativeLimits(num_tokens=2, lookup_min=1, lookup_max=2, disable_by_batch_size=None)
    engine = make_engine(paged_model, num_blocks=3000, block_size=16, max_num_seqs=256, speculative=limits)
    engine.proposer = engine.scheduler.proposer = RankedProposer(tiny_model, limits)
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for _ in range(SAMPLES)]
    events = run_to_completion(engine)
    counts = Counter(tuple(e.token_id for e in events[i]) for i in ids)
    assert set(counts) <= set(exact)
    spec = engine.proposer.counts
    assert spec.accepted_tokens > 100 and spec.draft_tokens - spec.accepted_tokens > 100  # taken and refused
    kept = [k for k, p in exact.items() if SAMPLES * p >= 5]  # the test's usual validity rule
    rest = sum(p for k, p in exact.items() if k not in kept)
    observed = Counter({k: counts.get(k, 0) for k in kept})
    pooled = {**{k: exact[k] for k in kept}}
    if rest:
        observed[("rest",)] = SAMPLES - sum(observed.values())
        pooled[("rest",)] = rest
    assert _chi_square(observed, pooled) < _chi_square_critical(len(pooled) - 1)


def test_the_check_can_tell_a_biased_sampler():
    """The statistic rejects a sample that favours one outcome by a few points."""
    exact = {k: 1 / 27 for k in itertools.product(range(3), repeat=3)}
    biased = Counter({k: round(SAMPLES / 27) for k in exact})
    biased[(0, 0, 0)] += 60
    biased[(2, 2, 2)] -= 40
    assert _chi_square(biased, exact) > _chi_square_critical(26)
