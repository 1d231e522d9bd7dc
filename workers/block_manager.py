"""Paged KV-cache bookkeeping: fixed-size blocks, one block table per sequence.

The KV tensors are a pool of `num_blocks * block_size` token slots (see kv_cache.py).
A sequence owns the blocks in its `block_table`; token position p lives in slot
`block_table[p // block_size] * block_size + p % block_size`. Memory grows a block at a
time with the sequence, so nothing is reserved up to a maximum length.

Blocks are reference-counted so sequences can share them: `fork` gives a child the
parent's whole table (n > 1 choices prefill their prompt once). A sequence about to
write into a block it shares gets a private copy first (copy-on-write); `allocate`
returns those (source, destination) block pairs for the KV cache to copy.
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
        self._refs = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must take from the pool so `num_new_tokens` more tokens fit after its computed ones."""
        total = seq.num_computed_tokens + num_new_tokens
        needed = -(-total // self.block_size)  # ceil
        return max(0, needed - len(seq.block_table)) + int(self._needs_copy(seq, num_new_tokens))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Grow `seq.block_table` to cover `num_new_tokens` more tokens; return blocks to copy."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: need {needed}, have {len(self._free)}")
        copies = []
        if self._needs_copy(seq, num_new_tokens):
            index = seq.num_computed_tokens // self.block_size
            shared = seq.block_table[index]
            private = self._take()
            self._release(shared)
            seq.block_table[index] = private
            copies.append((shared, private))
        total = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) * self.block_size < total:
            seq.block_table.append(self._take())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks, shared until one of them writes."""
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self._refs[block] += 1

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references and forget what was computed."""
        for block in seq.block_table:
            self._release(block)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def max_tokens_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def _needs_copy(self, seq: Sequence, num_new_tokens: int) -> bool:
        """The first write lands in an existing block that another sequence also holds."""
        if num_new_tokens <= 0:
            return False
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self._refs[seq.block_table[index]] > 1

    def _take(self) -> int:
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)
