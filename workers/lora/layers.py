"""LoRA layers: a target linear plus each row's adapter delta, batched over the step.

Every adapted linear keeps the weights of all `max_loras` slots stacked: `lora_a`
[slots * parts * rank, in] and `lora_b` [slots * parts * rank, out] (B transposed, its
scale folded in; a lower-rank adapter is zero-padded to `rank`). A plain linear has one
part; a fused q/k/v or gate/up projection (fused_projections.py) has one part per
sibling, and its B rows of part p are non-zero only in that sibling's output columns, so
one product gives the concatenation of the siblings' deltas.

What a step computes is set by the model runner in the model's `LoraContext`:
- `LoraSegments` (eager steps): runs of packed rows that share an adapter. The runner
  sorts decode rows by slot, and each prefill chunk is one sequence, so a step has about
  one run per adapter present. The decode runs (`GroupedRuns`, two or more) take two
  batched products a layer, [runs, rows, features] against each run's slot of the stacked
  weights (a grouped GEMM by torch.bmm; runs of unequal length are padded); each prefill
  run is two small products on its row slice. Two batched calls instead of two per run:
  at 32 rows over 4 adapters on 2 EPYC cores a layer's delta took 0.45 ms a decoder
  layer as runs, 0.21 ms grouped (equal runs) and 0.33 ms padded. Rows with no adapter
  are in no run and cost nothing; nor does a run whose adapter leaves this layer alone
  (PEFT's default adapts only q and v).
- `LoraRowMask` (CUDA graph decode steps): each row's slot as a one-hot [rows, slots]
  computed on the device from the graph's slot-index input; the delta is taken over all
  slots and masked, so shapes never change and a replay serves any mix of adapters.
A step with no adapter row runs with no step set: the base layer alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class GroupedRuns:
    """Runs of consecutive rows (the step's decode rows with an adapter, sorted by slot),
    each taken as one [length, features] slice of a batched product. Made once per step
    (`of`), with what every layer reads; tensors are made by the first layer that needs them."""

    slots: tuple[int, ...]  # each run's slot, ascending
    starts: tuple[int, ...]  # each run's first row in the packed step
    lengths: tuple[int, ...]
    length: int  # the longest run: shorter ones are padded to it
    # (first, end) when the runs are equally long and back to back: the rows are then a
    # [runs, length] view, with no gather or scatter.
    rows: tuple[int, int] | None
    slot_span: tuple[int, int] | None  # (first, end) when the slots are consecutive: the weights are then a view
    _cache: dict = field(default_factory=dict)

    @classmethod
    def of(cls, runs: list[tuple[int, int, int]]) -> "GroupedRuns | None":
        """Grouped when that saves calls (two runs or more) and padding at most doubles the rows."""
        if len(runs) < 2:
            return None
        slots = tuple(slot for slot, _, _ in runs)
        starts = tuple(start for _, start, _ in runs)
        lengths = tuple(end - start for _, start, end in runs)
        length = max(lengths)
        if len(runs) * length > 2 * sum(lengths):
            return None
        # Equal lengths and no row between runs: a [runs, length] view of the rows.
        equal = starts == tuple(range(starts[0], starts[0] + len(runs) * length, length)) and \
            all(n == length for n in lengths)
        consecutive = slots == tuple(range(slots[0], slots[0] + len(slots)))
        return cls(slots, starts, lengths, length,
                   rows=(starts[0], starts[0] + sum(lengths)) if equal else None,
                   slot_span=(slots[0], slots[0] + len(slots)) if consecutive else None)

    def slot_index(self, device: torch.device) -> torch.Tensor:
        key = ("slots", device)
        if key not in self._cache:
            self._cache[key] = torch.tensor(self.slots, device=device)
        return self._cache[key]

    def padded(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gather [runs * length] row indices, keep [runs, length, 1]): a short run is
        padded with its own last row, whose padded products `keep` zeroes."""
        key = ("padded", device, dtype)
        if key not in self._cache:
            length = self.length
            gather = [start + min(i, n - 1) for start, n in zip(self.starts, self.lengths) for i in range(length)]
            keep = [float(i < n) for n in self.lengths for i in range(length)]
            self._cache[key] = (torch.tensor(gather, device=device),
                                torch.tensor(keep, dtype=dtype, device=device).view(len(self.slots), length, 1))
        return self._cache[key]


@dataclass(frozen=True)
class LoraSegments:
    runs: tuple[tuple[int, int, int], ...]  # (slot, first row, end row) in the packed step, each its own products
    grouped: GroupedRuns | None = None  # runs taken together by batched products


@dataclass
class LoraRowMask:
    onehot: torch.Tensor  # [rows, slots] in the model's dtype; a row with no adapter is all zero
    _widened: dict[int, torch.Tensor] = field(default_factory=dict)

    def widened(self, width: int) -> torch.Tensor:
        """[rows, slots * width]: each slot's flag repeated over its `width` stacked columns
        (made once per step and width, by the first layer that needs it)."""
        mask = self._widened.get(width)
        if mask is None:
            rows, slots = self.onehot.shape
            mask = self.onehot.unsqueeze(2).expand(rows, slots, width).reshape(rows, slots * width)
            self._widened[width] = mask
        return mask


class LoraContext:
    """The adapters of the step being computed, shared by every LoRA layer of one model."""

    def __init__(self) -> None:
        self.step: LoraSegments | LoraRowMask | None = None

    @contextmanager
    def active(self, step: LoraSegments | LoraRowMask | None) -> Iterator[None]:
        self.step = step
        try:
            yield
        finally:
            self.step = None


class LoraLinear(nn.Module):
    """Stands where a target linear stood (an `nn.Linear`, a CPU `PackedLinear` or
    `QuantizedLinear`, or a `FusedProjection`'s stacked linear); reads as a linear of the same shape."""

    def __init__(self, base: nn.Module, bounds: list[tuple[int, int]], num_slots: int, rank: int,
                 context: LoraContext, dtype: torch.dtype, device: torch.device) -> None:
        """`bounds`: the output columns of each part (one part for a plain linear)."""
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.bounds = list(bounds)
        self.rank = rank
        self.num_slots = num_slots
        self.width = len(self.bounds) * rank  # stacked rows one slot takes
        self.context = context
        rows = num_slots * self.width
        self.register_buffer("lora_a", torch.zeros(rows, self.in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(rows, self.out_features, dtype=dtype, device=device),
                             persistent=False)
        self.adapted = [False] * num_slots  # whether each slot's adapter has weights here
        self._slot_views()

    def _slot_views(self) -> None:
        """Each slot's (Aᵀ, B) as views of the stacked buffers, made once: a run then costs
        its two products only (the buffers are written in place, never replaced)."""
        w = self.width
        self.slot_weights = [(self.lora_a[s * w : (s + 1) * w].t(), self.lora_b[s * w : (s + 1) * w])
                             for s in range(self.num_slots)]
        # [slots, in, width] and [slots, width, out]: every slot's Aᵀ and B, for batched products.
        self.stacked_a = self.lora_a.view(self.num_slots, w, self.in_features).transpose(1, 2)
        self.stacked_b = self.lora_b.view(self.num_slots, w, self.out_features)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)  # .to() / .cuda() replace the buffers: views anew
        self._slot_views()
        return module

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.context.step
        if step is None:
            return y
        x2, y2 = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        if isinstance(step, LoraSegments):
            self._add_segments(x2, y2, step)
        else:
            h = (x2 @ self.lora_a.t()) * step.widened(self.width)
            y2.addmm_(h, self.lora_b)
        return y

    def _add_segments(self, x2: torch.Tensor, y2: torch.Tensor, step: LoraSegments) -> None:
        adapted, weights = self.adapted, self.slot_weights
        if step.grouped is not None and any(adapted[slot] for slot in step.grouped.slots):
            self._add_grouped(x2, y2, step.grouped)
        for slot, start, end in step.runs:
            if adapted[slot]:
                a_t, b = weights[slot]
                y2[start:end].addmm_(x2[start:end] @ a_t, b)

    def _add_grouped(self, x2: torch.Tensor, y2: torch.Tensor, runs: GroupedRuns) -> None:
        span = runs.slot_span
        if span is not None:
            a, b = self.stacked_a[span[0] : span[1]], self.stacked_b[span[0] : span[1]]
        else:
            index = runs.slot_index(x2.device)
            a, b = self.stacked_a.index_select(0, index), self.stacked_b.index_select(0, index)
        count, length = len(runs.slots), runs.length
        rows = runs.rows
        if rows is not None:
            first, end = rows
            h = torch.bmm(x2[first:end].reshape(count, length, self.in_features), a)
            y2[first:end].view(count, length, self.out_features).baddbmm_(h, b)
        else:
            gather, keep = runs.padded(x2.device, x2.dtype)
            h = torch.bmm(x2.index_select(0, gather).view(count, length, self.in_features), a).mul_(keep)
            y2.index_add_(0, gather, torch.bmm(h, b).view(count * length, self.out_features))

    def load_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter into `slot`: `parts` maps a part index to its (A [r, in],
        B [out_part, r] scaled); parts it leaves out, and rank padding, are zero."""
        first = slot * self.width
        with torch.no_grad():
            self.lora_a[first : first + self.width].zero_()
            self.lora_b[first : first + self.width].zero_()
            self.adapted[slot] = bool(parts)
            for part, (a, b) in parts.items():
                row, (start, end) = first + part * self.rank, self.bounds[part]
                rank = a.shape[0]
                self.lora_a[row : row + rank].copy_(a)
                self.lora_b[row : row + rank, start:end].copy_(b.t())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, parts={len(self.bounds)}, " \
               f"rank={self.rank}"
