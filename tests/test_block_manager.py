"""Paged KV-cache bookkeeping and KV tensor sizing."""

from __future__ import annotations

import pytest
import torch

from workers.block_manager import BlockManager
from workers.kv_cache import KVCacheShape, PagedKVCache
from workers.sampling_params import SamplingParams
from workers.sequence import Sequence


def make_seq(num_tokens: int, seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, list(range(10, 10 + num_tokens)), SamplingParams(), frozenset(), 10_000)


def test_allocation_grows_one_block_per_block_size_tokens():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(1)
    expected_blocks = []
    # Feed the sequence one token at a time, as decoding does.
    for total in range(1, 21):
        assert bm.blocks_needed(seq, 1) == (1 if (total - 1) % 4 == 0 else 0)
        assert bm.can_allocate(seq, 1)
        bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        assert len(seq.block_table) == -(-total // 4)
        assert bm.num_used_blocks == len(seq.block_table)
        assert bm.num_free_blocks == 10 - len(seq.block_table)
        expected_blocks = seq.block_table
    assert len(expected_blocks) == 5
    assert len(set(expected_blocks)) == 5  # no block handed out twice


def test_blocks_needed_counts_only_missing_blocks_for_a_chunk():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(30)
    assert bm.blocks_needed(seq, 9) == 3  # 9 tokens -> ceil(9/4)
    bm.allocate(seq, 9)
    seq.num_computed_tokens = 9
    assert bm.blocks_needed(seq, 3) == 0  # positions 9..11 still in block 2
    assert bm.blocks_needed(seq, 4) == 1  # position 12 opens block 3
    assert bm.blocks_needed(seq, 11) == 2  # up to position 19 -> 5 blocks total
    assert bm.blocks_needed(seq, 0) == 0


def test_two_sequences_get_disjoint_blocks():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = make_seq(5, 0), make_seq(7, 1)
    bm.allocate(a, 5)
    bm.allocate(b, 7)
    assert len(a.block_table) == 3 and len(b.block_table) == 4
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_free_blocks == 1


def test_free_returns_blocks_and_resets_computed_tokens():
    bm = BlockManager(num_blocks=6, block_size=4)
    seq = make_seq(12)
    bm.allocate(seq, 12)
    seq.num_computed_tokens = 12
    assert bm.num_free_blocks == 3
    bm.free(seq)
    assert bm.num_free_blocks == 6
    assert bm.num_used_blocks == 0
    assert seq.block_table == []
    assert seq.num_computed_tokens == 0
    # The freed blocks are usable again: all 6 can be handed out.
    big = make_seq(24, 1)
    assert bm.can_allocate(big, 24)
    bm.allocate(big, 24)
    assert sorted(big.block_table) == list(range(6))


def test_out_of_blocks_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(8)
    bm.allocate(a, 8)
    b = make_seq(8, 1)
    assert not bm.can_allocate(b, 8)
    assert bm.can_allocate(b, 4)
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.allocate(b, 8)
    assert b.block_table == []
    assert bm.num_free_blocks == 1


def test_invalid_sizes_rejected():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_max_tokens_capacity():
    assert BlockManager(7, 16).max_tokens_capacity() == 112


@pytest.mark.parametrize(
    "layers,kv_heads,head_dim,dtype,elem",
    [(2, 2, 16, torch.float32, 4), (30, 3, 64, torch.bfloat16, 2), (1, 8, 128, torch.float16, 2)],
)
def test_bytes_per_token_is_theoretical(layers, kv_heads, head_dim, dtype, elem):
    shape = KVCacheShape(layers, kv_heads, head_dim, dtype)
    assert shape.bytes_per_token == 2 * layers * kv_heads * head_dim * elem
    cache = PagedKVCache(shape, num_blocks=3, block_size=4, device=torch.device("cpu"))
    assert cache.nbytes == 3 * 4 * shape.bytes_per_token
    k, v = cache.layer(layers - 1)
    assert k.shape == (12, kv_heads, head_dim) and v.shape == (12, kv_heads, head_dim)
    assert k.dtype == dtype


def test_shape_from_model_config_uses_kv_heads(tiny_model):
    cfg = tiny_model.config
    shape = KVCacheShape.from_model_config(cfg, torch.float32)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        head_dim,
    )
    # 2 (K and V) * 2 layers * 2 kv heads * 16 dims * 4 bytes
    assert shape.bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_num_blocks_for_budget():
    shape = KVCacheShape(2, 2, 16, torch.float32)  # 512 bytes per token
    assert shape.num_blocks_for_budget(512 * 4 * 10, block_size=4) == 10
    assert shape.num_blocks_for_budget(512 * 4 * 10 - 1, block_size=4) == 9
    assert shape.num_blocks_for_budget(100, block_size=4) == 0
