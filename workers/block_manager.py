"""Paged KV-cache bookkeeping: fixed-size blocks and one block table per sequence.

The KV tensors are a pool of `num_blocks * block_size` token slots (see kv_cache.py).
A sequence owns the blocks in its `block_table`; token position p lives in slot
`block_table[p // block_size] * block_size + p % block_size`. Memory grows a block at a
time with the sequence, so nothing is reserved up to a maximum length.
"""

from __future__ import annotations

from collections import deque

from workers.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs so that `num_new_tokens` more tokens fit after its computed ones."""
        total = seq.num_computed_tokens + num_new_tokens
        needed = -(-total // self.block_size)  # ceil
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_new_tokens` more tokens. Caller checks can_allocate."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: need {needed}, have {len(self._free)}")
        for _ in range(needed):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks to the pool and forget what was computed."""
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def max_tokens_capacity(self) -> int:
        return self.num_blocks * self.block_size
