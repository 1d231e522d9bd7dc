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

from workers.core.seed_streams import MASK, mix

_UNIT = 2.0**-24  # float32 holds 24 bits of mantissa


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
        state = mix(self.keys ^ (self.positions & MASK))
        # Below 2**24 times a power of two: exact in float32.
        drawn = ((state[0] ^ state[1]) >> 8).astype(np.float32) * np.float32(_UNIT)
        return torch.from_numpy(drawn).to(device)
