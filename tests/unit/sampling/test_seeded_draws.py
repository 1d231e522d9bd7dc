"""Seeded draws by position (workers/sampling/seeded_draws.py): exact integer arithmetic,
uniform numbers, a function of (seed, choice, output position) only."""

from __future__ import annotations

import random

import numpy as np
import torch

from workers.contract.sampling_params import SamplingParams
from workers.core.seed_streams import mix as _mix
from workers.core.seed_streams import stream_key
from workers.core.sequence import Sequence
from workers.sampling.sampler import SamplingTensors
from workers.sampling.seeded_draws import SeededRows

CPU = torch.device("cpu")


def draws(seeds: list[int], choices: list[int], positions: list[int]) -> list[float]:
    keys = [stream_key(s, c) for s, c in zip(seeds, choices)]
    return SeededRows.build(list(range(len(seeds))), keys, positions, CPU).uniforms(CPU).tolist()


def test_array_hash_equals_the_integer_hash():
    """No int64 overflow or sign trouble: the array path gives Python's exact integers."""
    rng = random.Random(0)
    values = [rng.randrange(2**32) for _ in range(5000)] + [0, 1, 2**31 - 1, 2**31, 2**32 - 1]
    assert _mix(np.array(values, dtype=np.int64)).tolist() == [_mix(v) for v in values]


def test_a_draw_depends_on_seed_choice_and_position_only():
    seeds, choices, positions = [7, 7, 7, 8, 7 + 2**32], [0, 1, 0, 0, 0], [3, 3, 4, 3, 3]
    first = draws(seeds, choices, positions)
    assert len(set(first)) == 5  # each of the three (and the seed's high half) changes it
    reordered = draws(seeds[::-1], choices[::-1], positions[::-1])[::-1]
    assert reordered == first  # whatever the row or the batch
    assert draws([7], [1], [3]) == [first[1]]


def test_draws_are_uniform_and_independent_along_a_stream():
    n = 50_000
    along = torch.tensor(draws([42] * n, [0] * n, list(range(n))))
    across = torch.tensor(draws(list(range(n)), [0] * n, [0] * n))
    for u in (along, across):
        assert 0.0 <= u.min() and u.max() < 1.0
        counts = torch.histc(u, bins=20, min=0.0, max=1.0)
        expected = n / 20
        assert float(((counts - expected) ** 2 / expected).sum()) < 43.8  # chi2, 19 dof, p = 0.001
    assert abs(float(torch.corrcoef(torch.stack([along[:-1], along[1:]]))[0, 1])) < 0.02


def test_seeded_rows_draw_for_their_next_output_position():
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, seed=5), SamplingParams(temperature=1.0, seed=5)]
    seqs = [Sequence(i, [1, 2, 3], p, frozenset(), 100) for i, p in enumerate(params)]
    seqs[3].token_ids += [9, 9]  # two output tokens already
    tensors = SamplingTensors.from_sequences(seqs, 50, CPU)
    assert tensors.seeded.rows.tolist() == [0, 3]  # greedy and unseeded rows draw no seeded number
    assert tensors.seeded.positions.tolist() == [0, 2]
    ahead = SamplingTensors.from_sequences(seqs, 50, CPU, pending=1)  # async scheduling, one token in flight
    assert ahead.seeded.positions.tolist() == [1, 3]
