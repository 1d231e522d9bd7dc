"""Seeded random numbers by position: the k-th output token of a seeded choice always
draws the same uniform number, whatever shares its batch, and across a preemption, a
failed step undone, or a resume on another replica.

Each number is a counter-based hash of (seed, choice index, output position) rather than
the next draw of a generator object, so nothing has to be carried between steps or
replicas. The hash is Wellons' lowbias32, run in two lanes with different salts, as
int64 array operations over all seeded rows of a step at once. Every product is a 32-bit
value times a constant below 2**31, so it stays below 2**63: the arithmetic never
overflows and gives the same bits anywhere. The two lanes make a 64-bit state, so two
(seed, choice) streams coincide only if both lanes collide. The arrays are numpy's on the
host: a dozen operations on a few numbers cost microseconds there, where as torch
operations they cost about 0.25 ms a step on a 2-core CPU (and kernel launches on a GPU);
the numbers then join the step's uniform draws in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_MASK = 0xFFFFFFFF
_MUL_1, _MUL_2 = 0x21F0AAAD, 0x735A2D97  # lowbias32's multipliers, both below 2**31
_LANE_SALTS = (0x9E3779B9, 0x85EBCA6B)
_UNIT = 2.0**-24  # float32 holds 24 bits of mantissa


def _mix(x):
    """lowbias32 on values below 2**32: Python ints or int64 arrays alike."""
    x = x ^ (x >> 16)
    x = (x * _MUL_1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _MUL_2) & _MASK
    return x ^ (x >> 15)


def stream_key(seed: int, choice: int) -> tuple[int, int]:
    """Both lanes' state after hashing the seed (0 .. 2**63 - 1, the API's range) and the
    choice index: fixed for a sequence, so a step only hashes the output position."""
    words = (seed & _MASK, (seed >> 32) & _MASK, choice & _MASK)
    lanes = []
    for state in _LANE_SALTS:
        for word in words:
            state = _mix(state ^ word)
        lanes.append(state)
    return lanes[0], lanes[1]


@dataclass
class SeededRows:
    """The rows of a batch that draw by position, and what each draw is a function of."""

    rows: torch.Tensor  # [R] long, on the device: batch rows
    keys: np.ndarray  # [2, R] int64: each row's stream_key
    positions: np.ndarray  # [R] int64: the output position each row samples

    @classmethod
    def build(cls, rows: list[int], keys: list[tuple[int, int]], positions: list[int],
              device: torch.device) -> SeededRows:
        return cls(torch.tensor(rows, dtype=torch.long, device=device),
                   np.array(keys, dtype=np.int64).T, np.array(positions, dtype=np.int64))

    def uniforms(self, device: torch.device) -> torch.Tensor:
        """[R] float32 in [0, 1) on `device`: one number per row."""
        state = _mix(self.keys ^ (self.positions & _MASK))
        # Below 2**24 times a power of two: exact in float32.
        drawn = ((state[0] ^ state[1]) >> 8).astype(np.float32) * np.float32(_UNIT)
        return torch.from_numpy(drawn).to(device)
