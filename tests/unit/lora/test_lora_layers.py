"""workers.lora.layers: a step's adapter deltas taken as grouped batched products equal
those taken run by run, for runs of equal and unequal length and slots with gaps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.lora.layers import GroupedRuns, LoraContext, LoraLinear, LoraSegments

SLOTS, RANK, IN, OUT = 4, 4, 24, 40
BOUNDS = [(0, 16), (16, 40)]  # a fused projection of two siblings


def _layer(unadapted_slot: int | None = None) -> LoraLinear:
    torch.manual_seed(0)
    layer = LoraLinear(nn.Linear(IN, OUT, bias=False), BOUNDS, SLOTS, RANK, LoraContext(), torch.float32,
                       torch.device("cpu"))
    for slot in range(SLOTS):
        if slot != unadapted_slot:
            layer.load_slot(slot, {part: (torch.randn(RANK, IN), torch.randn(end - start, RANK))
                                   for part, (start, end) in enumerate(BOUNDS)})
    return layer


def _forward(layer: LoraLinear, x: torch.Tensor, step: LoraSegments) -> torch.Tensor:
    with layer.context.active(step):
        return layer(x)


@pytest.mark.parametrize("runs", [
    [(0, 2, 5), (1, 5, 8), (2, 8, 11), (3, 11, 14)],  # equal lengths, consecutive slots: views only
    [(0, 2, 3), (1, 3, 6), (3, 6, 8)],  # unequal lengths (padded), slot 2 absent (gathered weights)
    [(1, 0, 4), (2, 4, 8), (3, 8, 12)],  # equal, starting past slot 0
    [(0, 0, 3), (1, 5, 8)],  # equal lengths with rows between them (gathered)
])
@pytest.mark.parametrize("unadapted_slot", [None, 1])
def test_grouped_runs_equal_runs_taken_one_by_one(runs, unadapted_slot):
    layer = _layer(unadapted_slot)
    x = torch.randn(16, IN)
    grouped = GroupedRuns.of(runs)
    assert grouped is not None
    one_by_one = _forward(layer, x, LoraSegments(tuple(runs)))
    together = _forward(layer, x, LoraSegments((), grouped))
    torch.testing.assert_close(together, one_by_one, rtol=1e-5, atol=1e-5)
    # Rows in no run get the base layer's output only.
    covered = {row for _, start, end in runs for row in range(start, end)}
    plain = layer.base(x)
    for row in set(range(16)) - covered:
        torch.testing.assert_close(together[row], plain[row])


def test_grouping_is_left_out_where_it_saves_nothing_or_pads_too_much():
    assert GroupedRuns.of([(0, 0, 8)]) is None  # one run: two products either way
    assert GroupedRuns.of([(0, 0, 1), (1, 1, 2), (2, 2, 12)]) is None  # 30 padded rows for 12
    assert GroupedRuns.of([(0, 0, 4), (1, 4, 9)]).rows is None  # unequal: gathered
    assert GroupedRuns.of([(0, 0, 3), (1, 5, 8)]).rows is None  # not back to back: gathered
    assert GroupedRuns.of([(0, 2, 5), (1, 5, 8)]).rows == (2, 8)
    assert GroupedRuns.of([(0, 0, 4), (2, 4, 8)]).slot_span is None
