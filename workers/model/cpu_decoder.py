"""A step of decode rows through all of a model's fused layers in one C call (cpu_decoder.c):
the direct forward's fused layers without their six calls a layer from Python. Same
operations in the same order as the per-layer path, so the same bits; None where the C
source cannot be built or the layers are not all of the kind it takes."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.model.kv_cache import PagedKVCache
from workers.native.build import load_library
from workers.quant.native_kernels import kernels
from workers.quant.quantized_layers import QuantizedLinear

SOURCE = Path(__file__).with_name("cpu_decoder.c")


class _DecoderLayers(ctypes.Structure):
    """cpu_decoder.c's decoder_layers."""

    _fields_ = [(name, ctypes.c_int64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                                    "intermediate")] + [
        ("levels", ctypes.c_int32), ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("window", ctypes.c_int64), ("formats", ctypes.c_void_p), ("weights", ctypes.c_void_p),
        ("norms", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p), ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p), ("num_slots", ctypes.c_int64), ("block_size", ctypes.c_int64)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = load_library(SOURCE, "fused layers run one call per operation")
    if library is None:
        return None
    library.decoder_layers_supported.argtypes = [ctypes.c_void_p]
    library.decode_layers.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int]
    return library


@dataclass(frozen=True)
class FusedLayer:
    """What the one call needs of a fused layer (direct_forward.py's _Layer with its norms)."""

    qkv: QuantizedLinear
    o_proj: QuantizedLinear
    gate_up: QuantizedLinear
    down_proj: QuantizedLinear
    input_norm: torch.Tensor  # float32 RMSNorm weights
    post_norm: torch.Tensor
    eps: float
    scale: float
    window: int | None
    softcap: float | None


class DecodeLayers:
    """Every layer of a step of decode rows, in place on the hidden states."""

    def __init__(self, library: ctypes.CDLL, layers: list[FusedLayer], heads: int, kv_heads: int, head_dim: int):
        self._library = library
        first = layers[0]
        self.hidden, self.intermediate = first.qkv.in_features, first.down_proj.in_features
        self.qkv_width, self.attn_width = (heads + 2 * kv_heads) * head_dim, heads * head_dim
        products = [(layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj) for layer in layers]
        # Kept referenced: the C struct holds their addresses.
        self._formats = torch.tensor([[p.fmt for p in row] for row in products], dtype=torch.int32)
        self._weights = torch.tensor([[p.blocks.data_ptr() for p in row] for row in products], dtype=torch.int64)
        self._norms = torch.tensor([[layer.input_norm.data_ptr(), layer.post_norm.data_ptr()] for layer in layers],
                                   dtype=torch.int64)
        self._biases = [layer.qkv.bias.detach().float().contiguous() if layer.qkv.bias is not None else None
                        for layer in layers]
        self._bias_addresses = torch.tensor([0 if b is None else b.data_ptr() for b in self._biases],
                                            dtype=torch.int64)
        self._owners = layers  # the weights and norms stay alive as long as this does
        self._struct = _DecoderLayers(
            layers=len(layers), hidden=self.hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            intermediate=self.intermediate, levels=first.qkv.levels, eps=first.eps, scale=first.scale,
            softcap=first.softcap or 0.0, window=first.window or 0, formats=self._formats.data_ptr(),
            weights=self._weights.data_ptr(), norms=self._norms.data_ptr(),
            qkv_bias=self._bias_addresses.data_ptr(), keys=None, values=None, num_slots=0, block_size=1)
        self.supported = bool(library.decoder_layers_supported(ctypes.byref(self._struct)))
        self._widest = max(self.hidden, self.attn_width, self.intermediate)  # the products' largest input

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, cache: PagedKVCache) -> bool:
        """x [M, hidden] float32 (owned: changed in place), each row a decode row of the C
        attention: its cache slot, block table [M, W] and context length [M] (itself
        included). False (x untouched) where the call does not take this step."""
        if (cache.keys.dtype != torch.float32 or tables.dtype != torch.int64 or lens.dtype != torch.int32
                or slots.dtype != torch.int64):
            return False
        rows = x.shape[0]
        struct = self._struct
        struct.keys, struct.values = cache.keys.data_ptr(), cache.values.data_ptr()
        struct.num_slots, struct.block_size = cache.keys.shape[1], cache.block_size
        tables, lens, slots = tables.contiguous(), lens.contiguous(), slots.contiguous()
        qkv = torch.empty(rows, self.qkv_width, dtype=torch.float32)
        attn = torch.empty(rows, self.attn_width, dtype=torch.float32)
        gate_up = torch.empty(rows, 2 * self.intermediate, dtype=torch.float32)
        work = kernels().work_buffer(rows, self._widest, struct.levels)
        status = self._library.decode_layers(
            ctypes.byref(struct), x.data_ptr(), rows, cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.shape[1], lens.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(),
            work.data_ptr(), torch.get_num_threads())
        return status == 0


def decode_layers_for(layers: list[FusedLayer], heads: int, kv_heads: int, head_dim: int) -> DecodeLayers | None:
    """The one-call step for these layers, or None: the C source not built, or layers that
    differ in what the call holds once (activation levels, eps, the attention's scale,
    window or cap, a gate/up bias), or a shape the product does not take."""
    library = _library()
    if library is None or not layers:
        return None
    first = layers[0]
    shared = (first.qkv.levels, first.eps, first.scale, first.window, first.softcap)
    same = all((layer.eps, layer.scale, layer.window, layer.softcap) == shared[1:]
               and {p.levels for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)} == {shared[0]}
               for layer in layers)
    if not same or any(layer.gate_up.bias is not None for layer in layers):
        return None
    decoder = DecodeLayers(library, layers, heads, kv_heads, head_dim)
    return decoder if decoder.supported else None
