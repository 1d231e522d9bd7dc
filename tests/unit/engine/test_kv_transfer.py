"""A prompt's KV blocks carried from one engine to another (workers/engine/kv_transfer.py,
prefill/decode disaggregation), on the tiny model: the decode engine, given the prefill
engine's blocks and the first token, prefills only the prompt's last partial block and
that token, and its output equals an uninterrupted run's; blocks it already holds are not
written again; an adapter's blocks never serve another; blocks of another layout are
refused."""

from __future__ import annotations

import pytest
import torch

from tests.support.engines import make_engine, run_to_completion, template_ids
from workers.contract.sampling_params import SamplingParams
from workers.engine.kv_transfer import KVBlocks

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt(tiny_tokenizer) -> list[int]:
    return template_ids(tiny_tokenizer, "Tell me about the quick brown fox and the lazy dog, at length.")


def outputs(engine, request_id: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for event in run_to_completion(engine)[request_id]:
        out.setdefault(event.index, []).append(event.token_id)
    return out


def prefilled(model, prompt, params) -> tuple[KVBlocks, dict[int, list[int]]]:
    """The prefill side: the request up to each choice's first token, then its blocks."""
    engine = make_engine(model)
    request_id = engine.add_request(prompt, params)
    first: dict[int, list[int]] = {}
    while len(first) < params.n:
        for event in engine.step():
            first.setdefault(event.index, [event.token_id])
    engine.abort_request(request_id)
    payload = engine.export_prefix(prompt)
    assert engine.blocks.num_used_blocks == 0  # the request's blocks are free, still cached
    return payload, first


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=2,
                                                           ignore_eos=True)], ids=["greedy", "seeded-n2"])
def test_the_decode_engine_goes_on_as_an_uninterrupted_run(paged_model, prompt, params):
    reference = make_engine(paged_model)
    whole = outputs(reference, reference.add_request(prompt, params))
    payload, first = prefilled(paged_model, prompt, params)
    bs = 4
    assert len(payload.token_ids) == len(prompt) // bs * bs and payload.token_ids == prompt[:len(payload.token_ids)]
    assert payload.keys.shape[1:3] == (len(prompt) // bs, bs) and payload.dtype == "float32"
    decode = make_engine(paged_model)
    assert decode.import_prefix(payload) == len(prompt) // bs
    choices = decode.replay_output(prompt, params, first, decode.compile_guide(params))
    request_id = decode.add_request(prompt, params, resume=choices)
    rest = outputs(decode, request_id)
    assert {i: first[i] + rest[i] for i in rest} == whole
    assert decode.blocks.hit_tokens == len(payload.token_ids) * params.n  # each choice found the prompt's blocks


def test_blocks_already_held_are_not_written_again(paged_model, prompt):
    payload, _ = prefilled(paged_model, prompt, GREEDY)
    decode = make_engine(paged_model)
    assert decode.import_prefix(payload) == len(payload.token_ids) // 4
    keys = decode.kv_cache.keys.clone()
    assert decode.import_prefix(payload) == 0
    assert torch.equal(decode.kv_cache.keys, keys)
    shorter = KVBlocks(payload.token_ids[:8], payload.dtype, payload.keys[:, :2], payload.values[:, :2])
    assert decode.import_prefix(shorter) == 0


def test_an_adapters_blocks_serve_only_that_adapter(paged_model, prompt):
    payload, _ = prefilled(paged_model, prompt, GREEDY)
    decode = make_engine(paged_model)
    assert decode.import_prefix(payload, lora="adapter-a") == len(payload.token_ids) // 4
    assert decode.export_prefix(prompt) is None  # the base model's chain is not cached
    assert decode.export_prefix(prompt, lora="adapter-a").token_ids == payload.token_ids


def test_blocks_of_another_layout_are_refused(paged_model, prompt):
    payload, _ = prefilled(paged_model, prompt, GREEDY)
    decode = make_engine(paged_model, block_size=8, num_blocks=128)
    assert decode.import_prefix(payload) == 0
    wrong_heads = KVBlocks(payload.token_ids, payload.dtype, payload.keys[:, :, :, :1], payload.values[:, :, :, :1])
    assert make_engine(paged_model).import_prefix(wrong_heads) == 0
    wrong_dtype = KVBlocks(payload.token_ids, "float16", payload.keys, payload.values)
    assert make_engine(paged_model).import_prefix(wrong_dtype) == 0


def test_a_full_pool_takes_what_fits(paged_model, prompt):
    payload, _ = prefilled(paged_model, prompt, GREEDY)
    decode = make_engine(paged_model, num_blocks=3)
    assert decode.import_prefix(payload) == 3
    assert decode.blocks.num_free_blocks == 3  # imported blocks wait, evictable, in the free pool


def test_bfloat16_blocks_travel_as_their_bits():
    """numpy has no bfloat16: the payload holds the int16 bits, and the blocks written are the
    exported ones bit for bit (here straight from two pools, no model)."""
    from workers.engine.block_manager import BlockManager
    from workers.engine.kv_transfer import export_blocks, import_blocks
    from workers.model.kv_cache import KVCacheShape, PagedKVCache

    shape = KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    source, target = (BlockManager(16, 4) for _ in range(2))
    source_cache, target_cache = (PagedKVCache(shape, 16, 4, torch.device("cpu")) for _ in range(2))
    source_cache.keys.normal_()
    source_cache.values.normal_()
    ids = list(range(100, 113))  # 3 whole blocks and a partial one
    held = [block for _, block in source.cache_blocks(ids, b"", 0, 3)]
    payload = export_blocks(source, source_cache, ids, b"")
    assert payload.dtype == "bfloat16" and payload.keys.dtype.name == "int16" and len(payload.token_ids) == 12
    assert import_blocks(target, target_cache, payload, b"") == 3
    written = target.cached_blocks(target.prefix_hashes(ids))
    for pool, other in ((source_cache.keys, target_cache.keys), (source_cache.values, target_cache.values)):
        for a, b in zip(held, written):
            assert torch.equal(pool[:, a * 4:(a + 1) * 4], other[:, b * 4:(b + 1) * 4])


def test_a_receiver_holding_the_first_blocks_takes_only_the_rest(paged_model, prompt):
    """An earlier turn cached the conversation's first blocks on the decode engine: the
    payload after them is written behind those, and the request finds the whole prompt."""
    payload, _ = prefilled(paged_model, prompt, GREEDY)
    decode = make_engine(paged_model)
    earlier = prompt[:9]  # two whole blocks of 4
    decode.add_request(earlier, SamplingParams(max_tokens=1))
    run_to_completion(decode)
    held = decode.held_prefix_blocks(prompt)
    assert held == 2
    rest = payload.after(held)
    assert rest.first_block == 2 and rest.keys.shape[1] == payload.keys.shape[1] - 2
    assert decode.import_prefix(rest) == payload.keys.shape[1] - 2
    assert decode.held_prefix_blocks(prompt) == payload.keys.shape[1]
    orphan = make_engine(paged_model)  # holds nothing: blocks after a gap would never be found
    assert orphan.import_prefix(rest) == 0
