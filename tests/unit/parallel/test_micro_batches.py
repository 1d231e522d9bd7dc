"""A pipeline step cut into micro-batches (workers/parallel/micro_batches.py): cuts fall
between sequences only, near equal shares; each part's metadata is its own rows indexed
from its start; the kept logits' rows map back to the step's order."""

from __future__ import annotations

import pytest
import torch

from workers.model.attention import AttentionMetadata, PrefillSpan
from workers.parallel import micro_batches as module
from workers.parallel.micro_batches import micro_batches


@pytest.fixture(autouse=True)
def small_parts(monkeypatch):
    monkeypatch.setattr(module, "MIN_MICRO_BATCH_TOKENS", 1)


def step(decodes: int, spans: list[int]) -> tuple[AttentionMetadata, int]:
    """Metadata of `decodes` decode rows, then one prefill span of each length in `spans`."""
    bounds = [decodes]
    for length in spans:
        bounds.append(bounds[-1] + length)
    prefills = [PrefillSpan(start, end, torch.arange(end - start + 3), None) for start, end in zip(bounds, bounds[1:])]
    tokens = bounds[-1]
    rows = torch.arange(decodes)
    meta = AttentionMetadata(
        kv_cache=None, slot_mapping=torch.arange(100, 100 + tokens), num_decode_tokens=decodes,
        decode_blocks=rows.view(-1, 1) if decodes else None, decode_mask=None, prefills=prefills,
        decode_context_lens=rows + 1 if decodes else None)
    return meta, tokens


def test_a_step_is_cut_only_where_each_part_keeps_enough_tokens(monkeypatch):
    monkeypatch.setattr(module, "MIN_MICRO_BATCH_TOKENS", 128)
    meta, tokens = step(200, [55])
    assert len(micro_batches(meta, tokens, torch.arange(200), 2)) == 1
    meta, tokens = step(200, [56])
    assert [(p.start, p.end) for p in micro_batches(meta, tokens, torch.arange(200), 4)] == [(0, 128), (128, 256)]


def test_a_step_is_cut_between_sequences_near_equal_shares():
    meta, tokens = step(5, [4, 11])  # decodes [0, 5), spans [5, 9) and [9, 20)
    assert [(p.start, p.end) for p in micro_batches(meta, tokens, torch.tensor([19]), 2)] == [(0, 9), (9, 20)]
    meta, tokens = step(8, [])
    assert [(p.start, p.end) for p in micro_batches(meta, tokens, torch.arange(8), 4)] == \
        [(0, 2), (2, 4), (4, 6), (6, 8)]
    meta, tokens = step(0, [30])  # one sequence: not cut
    assert [(p.start, p.end) for p in micro_batches(meta, tokens, torch.tensor([29]), 2)] == [(0, 30)]
    meta, tokens = step(1, [])
    assert len(micro_batches(meta, tokens, torch.tensor([0]), 3)) == 1


def test_each_part_holds_its_rows_indexed_from_its_start():
    meta, tokens = step(6, [5, 9])  # decodes [0, 6), spans [6, 11) and [11, 20); cut at 10 -> 11
    keep = torch.tensor([0, 1, 2, 3, 4, 5, 10, 19, 7, 8])  # one row a sequence, then prompt-logprob rows
    first, second = micro_batches(meta, tokens, keep, 2)
    assert (first.start, first.end, second.start, second.end) == (0, 11, 11, 20)
    assert first.meta.num_decode_tokens == 6 and second.meta.num_decode_tokens == 0
    assert second.meta.decode_blocks is None and second.meta.decode_context_lens is None
    assert torch.equal(first.meta.decode_context_lens, torch.arange(1, 7))
    assert [(s.start, s.end) for s in first.meta.prefills] == [(6, 11)]
    assert [(s.start, s.end) for s in second.meta.prefills] == [(0, 9)]
    assert torch.equal(second.meta.slot_mapping, torch.arange(111, 120))
    assert torch.equal(second.keep, torch.tensor([8])) and torch.equal(second.kept_at, torch.tensor([7]))
    # Logits of each part put at kept_at give the step's order of kept rows.
    merged = torch.empty(len(keep), dtype=torch.long)
    for part in (first, second):
        merged[part.kept_at] = part.keep + part.start
    assert torch.equal(merged, keep)


def test_a_cut_inside_the_decode_rows_splits_their_block_tables():
    meta, tokens = step(10, [2])  # decodes [0, 10), one span [10, 12); the share is 6
    first, second = micro_batches(meta, tokens, torch.arange(12), 2)
    assert (first.end, second.meta.num_decode_tokens) == (6, 4)
    assert torch.equal(second.meta.decode_blocks.flatten(), torch.arange(6, 10))
    assert [(s.start, s.end) for s in second.meta.prefills] == [(4, 6)]
