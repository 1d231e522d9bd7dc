"""CPU linear layers with their weights packed once for oneDNN.

bfloat16: `torch.nn.functional.linear` on CPU reorders the weight into oneDNN's blocked
layout on every call; a decode step calls it ~200 times. Reordering once at load time
(what torch.compile's CPU freezing and IPEX do) makes each call 1.5-2.8x faster on an
AMX machine; the default model's decode step is 1.2-1.4x faster than plain bfloat16 and
1.2x (batch 1) to 2.3x (batch 64) faster than float32 (docs/BENCHMARKS.md, "Engine
probes and design choices"). The results are plain bfloat16's: both accumulate in float32. A weight tied
to the input embedding is packed as a copy (the embedding keeps its own).

float32: torch runs float32 linears through MKL, whose small-batch kernels are slow on
some CPUs (AMD EPYC with AVX2: the default model's decode step is 1.3x faster packed) and
as fast as oneDNN on others (Intel with AMX: a wash). Which one a CPU is cannot be read
off its flags reliably, so a float32 model is packed only when a short probe at load
time finds oneDNN faster on this machine for the model's own layer shapes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The probe: the first layers of the model, at a decode batch of 1 and of 32 rows, the
# fastest of several rounds. Packing must win by this margin to be worth a second copy
# of a tied embedding and a result that differs from MKL's in the last bits.
PROBE_LAYERS = 8
PROBE_ROWS = (1, 32)
PROBE_ROUNDS = 12
PACKED_FLOAT32_MIN_SPEEDUP = 1.1


def onednn_bf16_available() -> bool:
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def has_native_bf16_matmul() -> bool:
    """True on CPUs with AMX tiles (Sapphire Rapids and later), where bfloat16 matmuls run
    on the matrix unit: there bfloat16 beats float32 at every batch size. Elsewhere
    bfloat16 is emulated or vector-only, and float32 stays the safe default."""
    return onednn_bf16_available() and bool(torch.cpu._is_amx_tile_supported())


def _packable(module: nn.Module, dtype: torch.dtype) -> bool:
    """A plain nn.Linear with a `dtype` weight on the CPU. Subclasses are left alone (they
    may compute differently), and so are layers a model keeps in another dtype."""
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == dtype)


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight lives only in oneDNN's packed layout.

    `weight` is kept as a meta tensor so code that reads a layer's shape or dtype (the
    engine reads the vocabulary size off the output embedding) still works; computing
    with it fails loudly instead of silently using stale numbers."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        # The packed tensor is neither a parameter nor a buffer: its bytes, for what reads a
        # model's weight bytes (loader.weight_bytes: memory, a draft's price per step).
        self.packed_nbytes = linear.weight.numel() * linear.weight.element_size()
        self.bias = linear.bias
        self.weight = torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _fastest_round_ms(layers: list[Callable[[torch.Tensor], torch.Tensor]], inputs: list[torch.Tensor]) -> float:
    with torch.inference_mode():
        for layer, x in zip(layers, inputs):  # warm-up: first-call allocations, oneDNN primitive cache
            layer(x)
        best = float("inf")
        for _ in range(PROBE_ROUNDS):
            start = time.perf_counter()
            for layer, x in zip(layers, inputs):
                layer(x)
            best = min(best, time.perf_counter() - start)
    return best * 1000


def probe_float32_packing(linears: list[nn.Linear]) -> tuple[float, float]:
    """(plain, packed) ms for one pass over `linears` at each of PROBE_ROWS rows, summed;
    each the fastest of PROBE_ROUNDS rounds (the least disturbed on a shared machine)."""
    packed = [PackedLinear(linear) for linear in linears]
    plain_ms = packed_ms = 0.0
    for rows in PROBE_ROWS:
        inputs = [torch.randn(rows, linear.in_features) for linear in linears]
        plain_ms += _fastest_round_ms(linears, inputs)
        packed_ms += _fastest_round_ms(packed, inputs)
    return plain_ms, packed_ms


def float32_packing_pays(model: nn.Module) -> bool:
    """Whether oneDNN's packed float32 linear beats torch's own on this CPU, for the first
    PROBE_LAYERS float32 layers of `model` (the output embedding left out: one layer of
    that size would dominate the probe's time)."""
    if not torch.backends.mkldnn.is_available():
        return False
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [m for m in model.modules() if _packable(m, torch.float32) and m is not output][:PROBE_LAYERS]
    if not linears:
        return False
    plain_ms, packed_ms = probe_float32_packing(linears)
    pays = plain_ms >= PACKED_FLOAT32_MIN_SPEEDUP * packed_ms
    logger.info("float32 linear probe (%d layers, rows %s): torch %.3f ms, oneDNN packed %.3f ms: %s",
                len(linears), PROBE_ROWS, plain_ms, packed_ms, "packing" if pays else "not packing")
    return pays


def pack_linear_layers(model: nn.Module, float32: bool | None = None) -> int:
    """Swap the plain CPU `nn.Linear`s of `model` for PackedLinears, in place: the bfloat16
    ones where oneDNN has bfloat16 kernels; the float32 ones when `float32` is True, or,
    when it is None, when `float32_packing_pays` on this CPU. Returns how many were
    swapped (0 for a CUDA model)."""
    dtypes = []
    if onednn_bf16_available():
        dtypes.append(torch.bfloat16)
    if float32 is None:
        float32 = float32_packing_pays(model)  # False at once for a model with no float32 CPU layer
    if float32 and torch.backends.mkldnn.is_available():
        dtypes.append(torch.float32)
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if any(_packable(child, dtype) for dtype in dtypes):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
