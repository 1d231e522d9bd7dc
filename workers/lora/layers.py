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
  one run per adapter present; each run is two small matrix products on row slices
  (no gather or scatter). Rows with no adapter are in no run and cost nothing; nor does a
  run whose adapter leaves this layer alone (PEFT's default adapts only q and v).
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


@dataclass(frozen=True)
class LoraSegments:
    runs: tuple[tuple[int, int, int], ...]  # (slot, first row, end row) in the packed step


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
    """Stands where a target linear stood (an `nn.Linear`, a CPU `PackedLinear`, or a
    `FusedProjection`'s stacked linear); reads as a linear of the same shape."""

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
        for slot, start, end in step.runs:
            if adapted[slot]:
                a_t, b = weights[slot]
                y2[start:end].addmm_(x2[start:end] @ a_t, b)

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
