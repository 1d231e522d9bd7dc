"""A prompt's KV blocks copied out of one engine's cache and into another's (prefill/decode
disaggregation: workers/contract/kv_handoff.py says the protocol).

Export reads the prompt's full blocks from the prefix cache, where they stay after the
prefill replica's request ended (registered by chain hash, evicted least recently used
first); the run stops at the first block no longer cached. Import takes free blocks,
writes the K/V into them and registers them under the same chain hashes, so the decode
replica's request finds them as a prefix-cache hit and computes only what follows. A
block the decode replica already caches is not written again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.block_manager import BlockManager
from workers.model.kv_cache import PagedKVCache


@dataclass
class KVBlocks:
    """The K and V of the first `len(token_ids)` tokens of a prompt (whole blocks), every
    layer: keys and values [layers, tokens, kv_heads, head_dim], on the CPU."""

    token_ids: list[int]
    block_size: int
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def export_blocks(blocks: BlockManager, cache: PagedKVCache, token_ids: list[int], salt: bytes) -> KVBlocks | None:
    """The cached full blocks of `token_ids` (salted as the request's sequence was), or None
    when not even the first is cached."""
    held = blocks.cached_blocks(blocks.prefix_hashes(token_ids, salt))
    if not held:
        return None
    slots = _slots(held, blocks.block_size, cache.keys.device)
    return KVBlocks(list(token_ids[:len(held) * blocks.block_size]), blocks.block_size,
                    cache.keys[:, slots].cpu(), cache.values[:, slots].cpu())


def import_blocks(blocks: BlockManager, cache: PagedKVCache, payload: KVBlocks, salt: bytes) -> int:
    """Write the payload's blocks this cache lacks into it; returns how many it wrote. A
    payload of another block size or layout writes nothing."""
    if payload.block_size != blocks.block_size or payload.keys.shape[0] != cache.keys.shape[0] or \
            payload.keys.shape[2:] != cache.keys.shape[2:]:
        return 0
    taken = blocks.cache_blocks(blocks.prefix_hashes(payload.token_ids, salt))
    if not taken:
        return 0
    bs, device = blocks.block_size, cache.keys.device
    source = _slots([index for index, _ in taken], bs, torch.device("cpu"))
    target = _slots([block for _, block in taken], bs, device)
    cache.keys[:, target] = payload.keys[:, source].to(device, cache.keys.dtype)
    cache.values[:, target] = payload.values[:, source].to(device, cache.values.dtype)
    return len(taken)


def _slots(block_ids: list[int], block_size: int, device: torch.device) -> torch.Tensor:
    """The token slots of `block_ids`, in order."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    return (ids[:, None] * block_size + torch.arange(block_size, device=device)).reshape(-1)
