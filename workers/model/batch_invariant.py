"""Batch invariance on the CPU (`engine.deterministic`): a sequence's logits depend only on
its own tokens, not on how many rows the step packs around it.

What varies with the batch, measured on a 2-core Xeon with AMX (2026-11-26,
/tmp/probe_inv2.py in the issue note): torch's float32 `F.linear` (MKL) gives a row other
sums at every batch size from 2 rows on; oneDNN's packed float32 linear gave every row the
sums of a one-row call at 1 to 512 rows; oneDNN's bfloat16 linear did up to 32 rows, not
beyond. The quantized layers' integer products are exact. Attention over a prompt (SDPA,
one call a span) and over a decode row (the C kernel) sum in other orders, so in this mode
every prompt span is attended by the kernel as decode rows (workers/model/attention.py).

So each linear layer runs in slices of at most `rows` rows, `rows` the largest size at
which this machine's kernel gives every row of a slice the sums of a one-row call, at every
batch size up to it: found at load time by `invariant_rows`, per layer shape (never
trusted untested: a CPU whose kernels block otherwise gets smaller slices, down to one row
at a time). On the Xeon above: 64 rows for float32, 32 for bfloat16.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from workers.model.cpu_linear import PackedLinear, pack_linear_layers
from workers.quant.quantized_layers import QuantizedLinear

logger = logging.getLogger(__name__)

# Tried from the largest; every batch size up to a candidate is probed (a slice's last part
# may have any of them), so the largest stays small; 1 (row by row) is invariant by construction.
SLICE_CANDIDATES = (64, 32, 8, 1)
# Each probed layer's answer: an engine built again on the same loaded model (a test's or
# benchmark's second engine, a draft engine beside its target) does not probe again (the
# default model's Q8_0 head alone takes ~9 s on one thread: 2,079 rows of 49,152 x 576).
_PROBED: weakref.WeakKeyDictionary[nn.Module, dict[torch.dtype, int]] = weakref.WeakKeyDictionary()


class RowSliced(nn.Module):
    """A linear layer called on at most `rows` rows at a time (rows beyond computed in
    further calls), so its sums for a row never depend on how many rows came with it."""

    def __init__(self, layer: nn.Module, rows: int) -> None:
        super().__init__()
        self.layer = layer
        self.rows = rows
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight = layer.weight  # a meta tensor for packed layers: shape and dtype only
        self.bias = getattr(layer, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= self.rows:
            return self.layer(x)
        out = torch.cat([self.layer(part) for part in flat.split(self.rows)])
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"rows={self.rows}"


def invariant_rows(layer: nn.Module, dtype: torch.dtype) -> int:
    """The largest candidate slice size at which `layer` gives each row the sums of a
    one-row call, at every batch size probed (1 to the candidate)."""
    answers = _PROBED.setdefault(layer, {})
    if dtype not in answers:
        answers[dtype] = _probe(layer, dtype)
    return answers[dtype]


def _probe(layer: nn.Module, dtype: torch.dtype) -> int:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(max(SLICE_CANDIDATES), layer.in_features, generator=generator).to(dtype)
    with torch.inference_mode():
        single = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        for rows in SLICE_CANDIDATES:
            if all(torch.equal(layer(x[:m]), single[:m]) for m in range(2, rows + 1)):
                return rows
    return 1


def invariant_for_free(model: nn.Module) -> bool:
    """Whether the mode leaves this model's output rate where it is: every linear layer
    keeps its weight in quantized blocks and multiplies 8-bit activations (each row summed
    on its own, no slices), so only long prompts' attention changes path, to the tiled
    kernel (a 2,000-token prompt's TTFT 1.04x on an AVX2 EPYC, 1.34x on an AMX Xeon whose
    SDPA is faster: docs/BENCHMARKS.md)."""
    linears = [m for m in model.modules() if isinstance(m, (PackedLinear, QuantizedLinear, nn.Linear))]
    return bool(linears) and all(isinstance(m, QuantizedLinear) and m.levels for m in linears)


def make_batch_invariant(model: nn.Module) -> int:
    """Swap every linear layer of `model` for a RowSliced one (float32 `nn.Linear`s packed
    for oneDNN first), in place, but for 8-bit quantized ones the probe finds invariant;
    idempotent. Returns the layers wrapped."""
    pack_linear_layers(model, float32=True)
    found: dict[tuple, int] = {}  # (class, in, out, dtype) -> slice rows
    wrapped = 0
    for parent in list(model.modules()):
        if isinstance(parent, RowSliced):
            continue  # its layer is wrapped already
        for name, child in list(parent.named_children()):
            if isinstance(child, RowSliced) or not isinstance(child, (PackedLinear, QuantizedLinear, nn.Linear)):
                continue
            dtype = child.weight.dtype
            key = (type(child), child.in_features, child.out_features, dtype)
            if key not in found:
                found[key] = invariant_rows(child, dtype)
            if isinstance(child, QuantizedLinear) and child.levels and found[key] == max(SLICE_CANDIDATES):
                # An 8-bit product sums each row on its own at any row count (cpu_kernels.c,
                # tested past 64 rows), as the probe confirms here: left whole, so the direct
                # forward runs it fused (its norms and adds inside, per row too).
                continue
            setattr(parent, name, RowSliced(child, found[key]))
            wrapped += 1
    logger.info("batch-invariant linears: %d layers; slice rows by shape %s", wrapped,
                {f"{k[0].__name__} {k[1]}x{k[2]} {str(k[3]).removeprefix('torch.')}": v for k, v in found.items()})
    return wrapped
