"""A prompt's KV blocks copied out of one engine's cache and into another's (prefill/decode
disaggregation: workers/contract/kv_handoff.py says the protocol).

Export reads the prompt's full blocks from the prefix cache, where they stay after the
prefill replica's request ended (registered by chain hash, evicted least recently used
first); the run stops at the first block no longer cached. Import takes free blocks,
writes the K/V into them and registers them under the same chain hashes, so the decode
replica's request finds them as a prefix-cache hit and computes only what follows. A
decode replica that already caches the prompt's first blocks (an earlier turn of the
conversation) takes only the blocks after them (`held_blocks`, `KVBlocks.after`), and a
block it caches meanwhile is not written again.

The payload holds numpy arrays, not tensors: Ray moves those through its object store
without pickling them (a 2,000-token prompt of the default model, 92 MB, pickled as
tensors took 0.9 s and unpickled 0.6 s on a 2-core EPYC; as arrays it is one copy into
shared memory). bfloat16, which numpy lacks, travels as its int16 bits.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from workers.engine.block_manager import BlockManager
from workers.model.kv_cache import PagedKVCache

_BITS_OF = {torch.bfloat16: torch.int16}  # dtypes numpy lacks, carried as their bits


@dataclass
class KVBlocks:
    """The K and V of the first `len(token_ids)` tokens of a prompt (whole blocks) from block
    `first_block` on, every layer: keys and values [layers, blocks, block_size, kv_heads,
    head_dim] in the cache's dtype (`dtype`, its name; bfloat16 as int16 bits). The token
    ids are all of them: the blocks' chain hashes start at the prompt's first token."""

    token_ids: list[int]
    dtype: str
    keys: np.ndarray
    values: np.ndarray
    first_block: int = 0

    def after(self, blocks: int) -> "KVBlocks":
        """The payload less its first `blocks` blocks (a receiver holds those already)."""
        skip = max(0, blocks - self.first_block)
        return KVBlocks(self.token_ids, self.dtype, self.keys[:, skip:], self.values[:, skip:],
                        self.first_block + skip)

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def export_blocks(blocks: BlockManager, cache: PagedKVCache, token_ids: list[int], salt: bytes) -> KVBlocks | None:
    """The cached full blocks of `token_ids` (salted as the request's sequence was), or None
    when not even the first is cached."""
    held = blocks.cached_blocks(blocks.prefix_hashes(token_ids, salt))
    if not held:
        return None
    ids = torch.tensor(held, dtype=torch.long, device=cache.keys.device)
    keys, values = (_by_block(pool, blocks.block_size).index_select(1, ids) for pool in (cache.keys, cache.values))
    return KVBlocks(list(token_ids[:len(held) * blocks.block_size]), str(cache.keys.dtype).removeprefix("torch."),
                    _array(keys), _array(values))


def held_blocks(blocks: BlockManager, token_ids: list[int], salt: bytes) -> int:
    """How many of the prompt's first full blocks this cache holds already."""
    return len(blocks.cached_blocks(blocks.prefix_hashes(token_ids, salt)))


def import_blocks(blocks: BlockManager, cache: PagedKVCache, payload: KVBlocks, salt: bytes) -> int:
    """Write the payload's blocks this cache lacks into it; returns how many it wrote. A
    payload of another block size, layout or dtype writes nothing."""
    expected = (cache.keys.shape[0], blocks.block_size, *cache.keys.shape[2:])
    if (payload.keys.shape[0], *payload.keys.shape[2:]) != expected or \
            payload.dtype != str(cache.keys.dtype).removeprefix("torch."):
        return 0
    if held_blocks(blocks, payload.token_ids[:payload.first_block * blocks.block_size], salt) < payload.first_block:
        return 0  # the blocks before the payload's are gone: its own would hang from nothing
    taken = blocks.cache_blocks(payload.token_ids, salt, payload.first_block, payload.keys.shape[1])
    if not taken:
        return 0
    device = cache.keys.device
    source = torch.tensor([index for index, _ in taken], dtype=torch.long)
    target = torch.tensor([block for _, block in taken], dtype=torch.long, device=device)
    for pool, part in ((cache.keys, payload.keys), (cache.values, payload.values)):
        written = _tensor(part, cache.keys.dtype).index_select(1, source).to(device)
        _by_block(pool, blocks.block_size).index_copy_(1, target, written)
    return len(taken)


def _by_block(pool: torch.Tensor, block_size: int) -> torch.Tensor:
    """A pool [layers, slots, heads, dim] seen as [layers, blocks, block_size, heads, dim]."""
    layers, slots, *rest = pool.shape
    return pool.view(layers, slots // block_size, block_size, *rest)


def _array(tensor: torch.Tensor) -> np.ndarray:
    bits = _BITS_OF.get(tensor.dtype)
    tensor = tensor.cpu()
    return (tensor.view(bits) if bits is not None else tensor).numpy()


def _tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # the object store's arrays are read-only; they are only read here
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    return tensor.view(dtype) if dtype in _BITS_OF else tensor
