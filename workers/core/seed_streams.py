"""The counter-based hash behind seeded sampling: a (seed, choice) stream's key, fixed for a
sequence, and the mix function that draws by output position from it
(workers/sampling/seeded_draws.py says why a hash and not a generator)."""

from __future__ import annotations

MASK = 0xFFFFFFFF
_MUL_1, _MUL_2 = 0x21F0AAAD, 0x735A2D97  # lowbias32's multipliers, both below 2**31
_LANE_SALTS = (0x9E3779B9, 0x85EBCA6B)


def mix(x):
    """lowbias32 on values below 2**32: Python ints or int64 arrays alike."""
    x = x ^ (x >> 16)
    x = (x * _MUL_1) & MASK
    x = x ^ (x >> 15)
    x = (x * _MUL_2) & MASK
    return x ^ (x >> 15)


def stream_key(seed: int, choice: int) -> tuple[int, int]:
    """Both lanes' state after hashing the seed (0 .. 2**63 - 1, the API's range) and the
    choice index: fixed for a sequence, so a step only hashes the output position."""
    words = (seed & MASK, (seed >> 32) & MASK, choice & MASK)
    lanes = []
    for state in _LANE_SALTS:
        for word in words:
            state = mix(state ^ word)
        lanes.append(state)
    return lanes[0], lanes[1]
