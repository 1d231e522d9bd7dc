"""Paged KV-cache bookkeeping and KV tensor sizing."""

from __future__ import annotations

import pytest
import torch

from workers.contract.sampling_params import SamplingParams
from workers.core.sequence import Sequence
from workers.engine.block_manager import (
    MAX_TAIL_CANDIDATES,
    NO_HIT,
    BlockManager,
    PrefixHit,
    chain_hash,
)
from workers.model.kv_cache import KVCacheShape, PagedKVCache


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


# --- prefix cache ----------------------------------------------------------------------


def prompt_seq(tokens: list[int], seq_id: int = 0, salt: bytes = b"", **params) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(**params), frozenset(), 10_000, cache_salt=salt)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Admit `seq` as the scheduler does and mark its whole prompt computed."""
    prefix = bm.cached_prefix(seq)
    bm.use_prefix(seq, prefix)
    bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)


def test_chain_hash_depends_on_tokens_parent_and_salt():
    a = chain_hash(None, [1, 2, 3, 4])
    assert a == chain_hash(None, [1, 2, 3, 4])
    assert a != chain_hash(None, [1, 2, 3, 5])
    assert a != chain_hash(None, [1, 2, 3, 4], salt=b"image")
    b = chain_hash(a, [5, 6, 7, 8])
    assert b != chain_hash(chain_hash(None, [0, 2, 3, 4]), [5, 6, 7, 8])  # same block, other prefix


def test_second_sequence_shares_full_prefix_blocks_by_reference():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = prompt_seq(range(10, 21))  # 11 tokens: 2 full blocks + 3
    compute_all(bm, a)
    assert bm.num_cached_blocks == 2
    b = prompt_seq(list(range(10, 18)) + [99, 98, 97], seq_id=1)  # shares the first 8 tokens
    prefix = bm.cached_prefix(b)
    assert prefix == PrefixHit(tuple(a.block_table[:2]), 8)  # a's last block is still being written
    assert bm.blocks_needed(b, 3, prefix) == 1  # only the block for tokens 8..10
    bm.use_prefix(b, prefix)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    bm.allocate(b, 3)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.num_used_blocks == 4  # 3 of a's + 1 of b's
    assert (bm.query_tokens, bm.hit_tokens) == (11 + 11, 8)


def test_chain_hash_needs_the_whole_prefix_not_just_the_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    compute_all(bm, prompt_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other_head = prompt_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], seq_id=1)  # block 1 equal, block 0 not
    assert bm.cached_prefix(other_head) == NO_HIT


def test_the_last_token_is_always_computed():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = prompt_seq(range(8))
    compute_all(bm, a)
    same = prompt_seq(range(8), seq_id=1)  # exactly two full blocks, both cached
    # the second is taken as a tail, all but its last token: that one is recomputed for the logits
    assert bm.cached_prefix(same) == PrefixHit(tuple(a.block_table), 7)


def test_salt_separates_equal_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    compute_all(bm, prompt_seq(range(9), salt=b"image-a"))
    assert bm.cached_prefix(prompt_seq(range(9), seq_id=1, salt=b"image-b")) == NO_HIT
    assert bm.cached_prefix(prompt_seq(range(9), seq_id=2)) == NO_HIT
    assert bm.cached_prefix(prompt_seq(range(9), seq_id=3, salt=b"image-a")).num_tokens == 8


def test_prompt_logprobs_requests_skip_the_cache():
    bm = BlockManager(num_blocks=16, block_size=4)
    compute_all(bm, prompt_seq(range(9)))
    assert bm.cached_prefix(prompt_seq(range(9), seq_id=1, prompt_logprobs=0)) == NO_HIT


def test_disabled_cache_never_shares():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    compute_all(bm, prompt_seq(range(9)))
    assert bm.num_cached_blocks == 0
    assert bm.cached_prefix(prompt_seq(range(9), seq_id=1)) == NO_HIT


def test_freed_blocks_stay_cached_and_are_reused():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = prompt_seq(range(9))
    compute_all(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 8  # cached blocks count as available
    b = prompt_seq(list(range(8)) + [50, 51], seq_id=1)
    prefix = bm.cached_prefix(b)
    assert prefix == PrefixHit(tuple(table[:2]), 8)  # a's tail holds token 8, b's next is 50
    assert bm.blocks_needed(b, 2, prefix) == 3  # 2 taken back out of the free pool + 1 new
    bm.use_prefix(b, prefix)
    assert bm.num_free_blocks == 6 and bm._refs[table[0]] == 1


def test_reference_counts_with_shared_prefix_and_fork():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = prompt_seq(range(9))
    compute_all(bm, a)
    b = prompt_seq(range(9), seq_id=1)
    compute_all(bm, b)
    shared = a.block_table[0]
    assert b.block_table[:2] == a.block_table[:2]
    child = b.fork(2, 1)
    bm.fork(b, child)
    assert bm._refs[shared] == 3
    bm.free(a)
    bm.free(b)
    assert bm._refs[shared] == 1 and shared not in bm._free  # still held by the child
    bm.free(child)
    assert bm._refs[shared] == 0 and bm.num_free_blocks == 16


def test_eviction_takes_never_used_then_least_recently_freed_blocks():
    bm = BlockManager(num_blocks=6, block_size=2)
    old, new = prompt_seq([1, 2, 3, 4, 5]), prompt_seq([7, 8, 9, 10, 11], seq_id=1)
    compute_all(bm, old)  # blocks 0..2, the first two cached
    compute_all(bm, new)  # blocks 3..5
    old_table = list(old.block_table)
    bm.free(old)
    bm.free(new)
    assert bm.num_cached_blocks == 4
    filler = prompt_seq(range(100, 104), seq_id=2)  # 2 blocks: must evict
    bm.allocate(filler, 4)
    # `old` was freed first, tail first: its partial block, then its 2nd cached block go.
    assert bm.cached_prefix(prompt_seq([1, 2, 3, 4, 5], seq_id=3)) == PrefixHit(tuple(old_table[:1]), 2)
    assert bm.cached_prefix(prompt_seq([7, 8, 9, 10, 11], seq_id=4)).num_tokens == 4
    assert bm.num_cached_blocks == 3


def test_a_cached_block_taken_for_new_tokens_loses_its_hash():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = prompt_seq([1, 2, 3])
    compute_all(bm, a)
    bm.free(a)
    b = prompt_seq([5, 6, 7, 8], seq_id=1)
    bm.allocate(b, 4)  # takes both blocks, evicting the cached one
    assert bm.num_cached_blocks == 0
    assert bm.cached_prefix(prompt_seq([1, 2, 3], seq_id=2)) == NO_HIT


def test_truncate_forgets_hashes_of_undone_blocks():
    seq = prompt_seq(range(7))
    bm = BlockManager(num_blocks=8, block_size=4)
    seq.token_ids.append(99)  # completes block 1
    bm._block_hashes(seq, 2)
    seq.truncate(7, 4)
    assert len(seq.block_hashes) == 1
    seq.token_ids.append(42)
    assert bm._block_hashes(seq, 2)[1] == chain_hash(seq.block_hashes[0], [4, 5, 6, 42])


# --- token-granular tail ---------------------------------------------------------------


def test_a_prompt_sent_again_recomputes_only_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = prompt_seq(range(10))  # blocks: 0-3, 4-7, then 8-9 in a partly filled block
    compute_all(bm, a)
    table = list(a.block_table)
    bm.free(a)  # the partly filled block is filed under block 1's hash
    b = prompt_seq(range(10), seq_id=1)
    prefix = bm.cached_prefix(b)
    assert prefix == PrefixHit(tuple(table), 9)
    assert bm.blocks_needed(b, 1, prefix) == 3 + 1  # three out of the free pool, one for the copy
    bm.use_prefix(b, prefix)
    assert b.num_computed_tokens == 9 and b.num_cached_tokens == 9 and b.num_cached_blocks == 2
    copies = bm.allocate(b, 1)
    private = b.block_table[2]
    assert copies == [(table[2], private)] and private != table[2]  # written into a copy, never in place
    assert bm._refs[table[2]] == 0 and table[2] in bm._free  # the cached tail goes back, still findable
    c = prompt_seq(range(10), seq_id=2)
    assert bm.cached_prefix(c) == PrefixHit(tuple(table), 9)


def test_a_full_block_serves_as_the_tail_of_a_shorter_prompt():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = prompt_seq(range(6))
    compute_all(bm, a)
    a.token_ids += [60, 61, 62]  # its answer: block 1 fills with 4, 5, 60, 61
    a.num_computed_tokens = 8
    bm.cache_computed_blocks(a)
    table = tuple(a.block_table)
    bm.free(a)
    regenerate = prompt_seq(range(6), seq_id=1)  # the same prompt again: 4 is cached, 5 is fed
    assert bm.cached_prefix(regenerate) == PrefixHit(table, 5)
    next_turn = prompt_seq(list(range(6)) + [60, 7, 8], seq_id=2)  # diverges inside block 1's answer
    assert bm.cached_prefix(next_turn).num_tokens == 7


def test_the_tail_shares_the_longest_run_among_the_children():
    bm = BlockManager(num_blocks=8, block_size=4)
    for seq_id, tokens in enumerate(([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 9, 9])):
        seq = prompt_seq(tokens, seq_id=seq_id)
        compute_all(bm, seq)
        bm.free(seq)
    hit = bm.cached_prefix(prompt_seq([0, 1, 2, 3, 4, 9, 9, 7], seq_id=5))
    assert hit.num_tokens == 7  # the second's tail (4, 9, 9), not the first's (4, 5)


def test_salt_separates_tails_too():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = prompt_seq([1, 2, 3], salt=b"adapter-a")
    compute_all(bm, a)
    bm.free(a)
    assert bm.cached_prefix(prompt_seq([1, 2, 3], seq_id=1)) == NO_HIT
    assert bm.cached_prefix(prompt_seq([1, 2, 3], seq_id=2, salt=b"adapter-a")).num_tokens == 2


def test_an_evicted_tail_is_no_longer_offered():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = prompt_seq([1, 2, 3])
    compute_all(bm, a)
    bm.free(a)
    filler = prompt_seq(range(100, 108), seq_id=1)
    bm.allocate(filler, 8)  # takes both blocks, the filed tail among them
    assert bm.cached_prefix(prompt_seq([1, 2, 3], seq_id=2)) == NO_HIT
    assert bm._children == {}


def test_a_sibling_writes_a_copy_of_a_block_its_freed_sibling_filed():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = prompt_seq(range(6))
    compute_all(bm, parent)
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    shared = parent.block_table[1]
    bm.free(parent)  # files the shared, partly filled block as a tail
    assert bm.cached_prefix(prompt_seq(range(6), seq_id=2)).num_tokens == 5
    copies = bm.allocate(child, 1)
    assert copies == [(shared, child.block_table[1])] and child.block_table[1] != shared


def test_a_parent_offers_only_its_most_recent_children_as_tails():
    bm = BlockManager(num_blocks=4 * MAX_TAIL_CANDIDATES, block_size=4)
    for seq_id in range(MAX_TAIL_CANDIDATES + 1):
        seq = prompt_seq([seq_id, 1, 2, 3, 4], seq_id=seq_id)  # a distinct first block each
        compute_all(bm, seq)
        first = seq.block_table[0]
        bm.free(seq)
    assert len(bm._children[bm._parent_of[first]]) == MAX_TAIL_CANDIDATES  # the root's
    assert bm.cached_prefix(prompt_seq([0, 1, 2, 3, 4], seq_id=100)).num_tokens == 4  # still by its hash
    assert bm.cached_prefix(prompt_seq([0, 1, 2], seq_id=101)) == NO_HIT  # no longer as a tail
    assert bm.cached_prefix(prompt_seq([1, 1, 2], seq_id=102)).num_tokens == 2


def test_blocks_arriving_from_another_replica_serve_as_tails_too():
    bm = BlockManager(num_blocks=8, block_size=4)
    ids = list(range(100, 109))  # 2 full blocks and one token
    taken = bm.cache_blocks(ids, b"", 0, 2)
    assert [index for index, _ in taken] == [0, 1]
    assert bm.cache_blocks(ids, b"", 1, 1) == []  # already cached
    shorter = prompt_seq(ids[:7], seq_id=1)  # block 0 by its hash, 3 tokens of block 1 as a tail
    assert bm.cached_prefix(shorter) == PrefixHit(tuple(block for _, block in taken), 6)
