"""Seeded random numbers by position: the k-th output token of a seeded choice always
draws the same uniform number, whatever shares its batch, and across a preemption, a
failed step undone, or a resume on another replica.

Each number is a counter-based hash of (seed, choice index, output position) rather than
the next draw of a generator object, so nothing has to be carried between steps or
replicas. The hash is Wellons' lowbias32, run in two lanes with different salts on int64
tensors for all seeded rows of a step at once. Every product is a 32-bit value times a
constant below 2**31, so it stays below 2**63: the arithmetic never overflows, and gives
the same bits on every device. The two lanes make a 64-bit state, so two (seed, choice)
streams coincide only if both lanes collide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = 0xFFFFFFFF
_MUL_1, _MUL_2 = 0x21F0AAAD, 0x735A2D97  # lowbias32's multipliers, both below 2**31
_LANE_SALTS = (0x9E3779B9, 0x85EBCA6B)
_UNIT = 2.0**-24  # float32 holds 24 bits of mantissa


def _mix(x):
    """lowbias32 on values below 2**32: Python ints or int64 tensors alike."""
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

    rows: torch.Tensor  # [R] long: batch rows
    keys: torch.Tensor  # [2, R] int64: each row's stream_key
    positions: torch.Tensor  # [R] int64: the output position each row samples

    @classmethod
    def build(cls, rows: list[int], keys: list[tuple[int, int]], positions: list[int],
              device: torch.device) -> SeededRows:
        return cls(torch.tensor(rows, dtype=torch.long, device=device),
                   torch.tensor(keys, dtype=torch.int64, device=device).T,
                   torch.tensor(positions, dtype=torch.int64, device=device))

    def uniforms(self) -> torch.Tensor:
        """[R] float32 in [0, 1): one number per row."""
        state = _mix(self.keys ^ (self.positions & _MASK))
        return ((state[0] ^ state[1]) >> 8).to(torch.float32) * _UNIT
