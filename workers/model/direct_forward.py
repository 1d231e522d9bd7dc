"""Llama-shaped decoders run by a loop of chatserve's own over their layers.

transformers' forward of a Llama layer goes through some twenty module calls, decorators
and keyword plumbing, and its RMSNorm and rotary embedding are about twenty small tensor
operators between them. On a CPU every call and operator costs microseconds of Python and
dispatch whatever the batch: at batch 1 on the default model they took about as long as
the linear layers (docs/BENCHMARKS.md). This forward calls the same weights with the
fewest operators: one fused RMSNorm (float32), the fused q/k/v and gate/up products, q and
k rotated in one pass, and the paged attention in its packed layout (`attend_packed`). It
computes what transformers' modules compute, in the same order, so the logits are the same
bit for bit (tests/unit/model/test_direct_forward.py); on a CPU the rotation and the KV
cache write are one C pass giving the same bits (cpu_attention.c). A layer whose products
are 8-bit QuantizedLinears goes further (`_FusedNorms`): its norms, SiLU gate and residual
adds run inside those products, within the activations' rounding of the separate operators
(tests/unit/model/test_fused_products.py). When every layer is fused, a step of decode rows
(and short spans the C attention takes as such) on the CPU runs all of them in one C call
(cpu_decoder.py: the same operations, one OpenMP region instead of six calls a layer).

It runs only what it was written for: Llama, Mistral, Qwen2 and Qwen3 models (Qwen3's
per-head RMSNorm of q and k included) with their sibling projections fused
(fused_projections.py), rotary positions, plain RMSNorm and a gated MLP; LoRA layers
where they wrap the products (workers/lora/layers.py: the runner sets each step's adapter
rows around the call). Anything else (other families, images) runs transformers' forward.

Split over shards by tensors (workers/parallel/), each shard runs this same loop on
its part of the heads and of the MLP: the group adds the shards' partial o_proj and
down_proj products, looks the ids up in the split vocabulary and gathers the logits to
the driver (the other shards get None).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.attention import AttentionMetadata, LayerAttention, attend_packed
from workers.model.cpu_attention import cpu_decode_attention
from workers.model.cpu_decoder import DecodeLayers, FusedLayer, decode_layers_for
from workers.model.fused_projections import ProjectionSlice
from workers.quant.native_kernels import PROLOGUE_RMS_NORM, PROLOGUE_SILU_GATE
from workers.quant.quantized_layers import QuantizedLinear

logger = logging.getLogger(__name__)

Norm = Callable[[torch.Tensor], torch.Tensor]


class ShardCollectives(Protocol):
    """What a tensor-parallel shard's forward needs of its group (workers/parallel/shard_group.py)."""

    world: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def embed(self, rows: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor: ...

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None: ...


def _layer_window(model: nn.Module, attn: nn.Module) -> int | None:
    """The layer's sliding window, as transformers' attention of the family passes it."""
    kind = type(model).__name__
    if kind == "MistralForCausalLM":
        return getattr(model.config, "sliding_window", None)
    if kind in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return attn.sliding_window
    return None


# The families whose decoder layer is Llama's (pre-norm attention and gated MLP, residual
# adds, no other scales), with their RMSNorm class; Qwen3 also norms each q and k head.
FAMILIES = {
    "LlamaForCausalLM": "LlamaRMSNorm",
    "MistralForCausalLM": "MistralRMSNorm",
    "Qwen2ForCausalLM": "Qwen2RMSNorm",
    "Qwen3ForCausalLM": "Qwen3RMSNorm",
}
HEAD_NORMS = {"Qwen3ForCausalLM"}  # families whose attention norms q and k per head before the rotation
# The products the forward calls as modules: a LoraLinear adds each row's adapter delta
# (workers/lora/layers.py), from the step the model runner sets around the call.
LINEAR_KINDS = ("Linear", "PackedLinear", "LoraLinear", "QuantizedLinear", "DeviceQuantizedLinear", "RowSliced")


@dataclass(frozen=True)
class _FusedNorms:
    """A layer whose four products are 8-bit QuantizedLinears: its RMSNorms and SiLU run
    inside them (cpu_kernels.c's prologues) and o_proj and down_proj add into the residual
    stream in place: five calls a layer instead of some twenty small operators."""

    input: torch.Tensor  # RMSNorm weights, float32
    post: torch.Tensor
    eps: float


def _norm_weights(module: nn.Module) -> tuple[torch.Tensor, float] | None:
    """A float32 RMSNorm's (weight, eps), or None for another dtype."""
    weight = module.weight
    return (weight.detach().contiguous(), float(module.variance_epsilon)) if weight.dtype == torch.float32 else None


def _fused_norms(layer: nn.Module, products: tuple[nn.Module, ...], act: nn.Module) -> _FusedNorms | None:
    """The layer's _FusedNorms where the fused path computes it, else None."""
    qkv, o_proj, gate_up, down_proj = products
    if not all(type(m) is QuantizedLinear for m in products) or type(act).__name__ not in SILU_KINDS:
        return None
    if not (qkv.fusable() and gate_up.fusable() and o_proj.fusable(accumulate=True)
            and down_proj.fusable(accumulate=True)):
        return None
    norms = _norm_weights(layer.input_layernorm), _norm_weights(layer.post_attention_layernorm)
    if norms[0] is None or norms[1] is None or norms[0][1] != norms[1][1]:
        return None
    return _FusedNorms(norms[0][0], norms[1][0], norms[0][1])


SILU_KINDS = ("SiLU", "SiLUActivation")


@dataclass(frozen=True)
class _Layer:
    index: int
    input_norm: Norm
    qkv: nn.Module  # the fused q/k/v product: [T, hidden] -> [T, (H + 2 KVH) * Dh]
    head_norms: tuple[Norm, Norm] | None  # Qwen3: RMSNorm over each q head and each k head
    o_proj: nn.Module
    post_norm: Norm
    gate_up: nn.Module  # the fused gate/up product: [T, hidden] -> [T, 2 * I]
    act: nn.Module
    down_proj: nn.Module
    attention: LayerAttention
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    fused: _FusedNorms | None  # its norms and activation inside its quantized products


def _rms_norm(module: nn.Module) -> Norm:
    """float32: torch's fused RMSNorm over the last dimension (what transformers' module
    computes, in one operator); other dtypes: the module itself, which rounds its normalized
    input to the model's dtype before the weight multiplies it."""
    weight, eps = module.weight, module.variance_epsilon
    if weight.dtype != torch.float32:
        return module
    shape = (weight.shape[0],)
    return lambda x: F.rms_norm(x, shape, weight, eps)


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `model` cannot run the direct forward, or None when it can."""
    kind = type(model).__name__
    if kind not in FAMILIES:
        return f"{kind} is not a Llama-shaped family ({', '.join(FAMILIES)})"
    norm_class = FAMILIES[kind]
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and type(module).__name__ != norm_class:
            return f"an RMSNorm of another class ({type(module).__name__})"
    for index, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "q_norm") != (kind in HEAD_NORMS):
            return f"layer {index}'s attention {'lacks' if kind in HEAD_NORMS else 'has'} per-head q/k norms"
        if not all(isinstance(getattr(attn, name), ProjectionSlice) for name in ("q_proj", "k_proj", "v_proj")):
            return f"layer {index}'s q/k/v projections are not fused"
        if not all(isinstance(getattr(mlp, name), ProjectionSlice) for name in ("gate_proj", "up_proj")):
            return f"layer {index}'s gate/up projections are not fused"
        if type(attn.o_proj).__name__ not in LINEAR_KINDS:
            return f"layer {index}'s o_proj is a {type(attn.o_proj).__name__}"
        if type(mlp.down_proj).__name__ not in LINEAR_KINDS:
            return f"layer {index}'s down_proj is a {type(mlp.down_proj).__name__}"
    return None


class DirectForward:
    """The model's logits for one packed step, without transformers' module calls."""

    def __init__(self, model: nn.Module, shards: ShardCollectives | None = None, layers: range | None = None):
        """`shards`: the group `model` was split over (workers/parallel/tensor_split.py).
        `layers`: a pipeline stage's layers only (workers/parallel/pipeline.py), indexed from
        0 in its own KV pool; the other layers' weights may be absent (on the meta device)."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the direct forward cannot run this model: {reason}")
        config, body = model.config, model.model
        self.shards = shards
        self.vocab_size = config.vocab_size
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.final_norm = _rms_norm(body.norm)
        self.lm_head = model.lm_head
        self.hidden_size = config.hidden_size
        world = shards.world if shards is not None else 1
        heads, kv_heads = config.num_attention_heads // world, config.num_key_value_heads // world
        layers = layers if layers is not None else range(len(body.layers))
        self.layers = [self._layer(model, index - layers.start, body.layers[index], heads, kv_heads,
                                   fusable=shards is None)
                       for index in layers]
        self.decode_layers = self._decode_layers() if shards is None else None
        head_norm = _norm_weights(body.norm)
        self.fused_head = (head_norm if shards is None and head_norm is not None
                           and type(self.lm_head) is QuantizedLinear and self.lm_head.fusable() else None)

    def _decode_layers(self) -> DecodeLayers | None:
        """The one-call decode step over every layer, where all are fused without head norms."""
        if not self.layers or any(layer.fused is None or layer.head_norms is not None for layer in self.layers):
            return None
        first = self.layers[0]
        return decode_layers_for(
            [FusedLayer(layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj, layer.fused.input, layer.fused.post,
                        layer.fused.eps, layer.attention.scale, layer.attention.window, layer.attention.softcap)
             for layer in self.layers],
            first.heads, first.kv_heads, first.head_dim)

    @staticmethod
    def _layer(model: nn.Module, index: int, layer: nn.Module, heads: int, kv_heads: int, fusable: bool) -> _Layer:
        """`fusable`: the layer may run fused (not on a tensor shard, whose products are partial sums)."""
        attn, mlp = layer.self_attn, layer.mlp
        products = attn.q_proj.fused.linear, attn.o_proj, mlp.gate_proj.fused.linear, mlp.down_proj
        return _Layer(
            index=index,
            input_norm=_rms_norm(layer.input_layernorm),
            qkv=attn.q_proj.fused.linear,
            head_norms=(_rms_norm(attn.q_norm), _rms_norm(attn.k_norm)) if hasattr(attn, "q_norm") else None,
            o_proj=attn.o_proj,
            post_norm=_rms_norm(layer.post_attention_layernorm),
            gate_up=mlp.gate_proj.fused.linear,
            act=mlp.act_fn,
            down_proj=mlp.down_proj,
            attention=LayerAttention(attn.scaling, _layer_window(model, attn), None),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=attn.head_dim,
            intermediate=mlp.gate_proj.out_features,
            fused=_fused_norms(layer, products, mlp.act_fn) if fusable else None,
        )

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMetadata,
                 logits_to_keep: torch.Tensor) -> torch.Tensor | None:
        """input_ids, position_ids [1, T]; the logits of the `logits_to_keep` rows [1, K, vocab]
        in the model's dtype, as transformers' forward returns them (None on a shard that is
        not its group's driver)."""
        return self.head(self.run_layers(self.embed_ids(input_ids), position_ids, meta), logits_to_keep)

    def embed_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[1, T] ids -> [T, hidden]."""
        if self.shards is None:
            return self.embed(input_ids[0])
        return self.shards.embed(self.embed.weight, input_ids[0], self.vocab_size)

    def run_layers(self, x: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states [T, hidden] through this forward's layers."""
        cos, sin = self.rotary(x, position_ids)
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, Dh]: one angle per position, every head
        # transformers rotates by q * cos + cat(-q2, q1) * sin. cat(q2, q1) is one roll, and
        # the sign moves onto the sine once a step: -(a * b) == a * -b exactly in floats.
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        owned = False  # the fused layers add into x in place: once on a copy of their own
        rows = self._one_call_rows(x, meta)
        if rows is not None:
            x, owned = x.clone(), True  # a declined call leaves it untouched for the loop below
            if self.decode_layers(x, cos, signed_sin, meta.slot_mapping, *rows, meta.kv_cache):
                return x
        for layer in self.layers:
            if layer.fused is not None:
                if not owned:
                    x, owned = x.clone(), True
                self._fused_layer(layer, x, cos, signed_sin, meta)
                continue
            x = x + self._summed(self._attention(layer, layer.input_norm(x), cos, signed_sin, meta))
            x = x + self._summed(self._mlp(layer, layer.post_norm(x)))
            owned = True
        return x

    def _one_call_rows(self, x: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every row of the step as a decode row of the C attention ([T, W] block tables,
        [T] context lengths) where the one call takes the step: decode rows, and spans the
        per-layer path would also give the kernel as decode rows (a speculative
        verification, a short chunk after cached context); else None."""
        if (self.decode_layers is None or not meta.cpu_decode or x.dtype != torch.float32
                or x.device.type != "cpu"):
            return None
        tables, lens, position = [], [], meta.num_decode_tokens
        if position:
            if meta.decode_blocks is None or meta.decode_context_lens is None:
                return None
            tables.append(meta.decode_blocks)
            lens.append(meta.decode_context_lens)
        for span in meta.prefills:
            if (span.start != position or span.context_slots is None
                    or span.end - span.start > meta.kernel_span):
                return None
            span_tables, span_lens = span.as_decode_rows(meta.kv_cache.block_size)
            tables.append(span_tables)
            lens.append(span_lens)
            position = span.end
        if position != x.shape[0] or not tables:
            return None
        if len(tables) == 1:
            return tables[0], lens[0]
        table = torch.zeros(position, max(t.shape[1] for t in tables), dtype=torch.int64)  # past a row's length: unread
        first = 0
        for part in tables:
            table[first:first + part.shape[0], :part.shape[1]] = part
            first += part.shape[0]
        return table, torch.cat(lens)

    def head(self, x: torch.Tensor, logits_to_keep: torch.Tensor) -> torch.Tensor | None:
        """The logits [1, K, vocab] of the kept rows (None on a tensor shard that is not the driver)."""
        if self.fused_head is not None:
            weight, eps = self.fused_head
            return self.lm_head.fused(x[logits_to_keep], PROLOGUE_RMS_NORM, weight, eps).unsqueeze(0)
        logits = self.lm_head(self.final_norm(x[logits_to_keep]))
        if self.shards is not None:
            logits = self.shards.gather_logits(logits, self.vocab_size)
        return logits.unsqueeze(0) if logits is not None else None

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-split product: the sum of every shard's part (itself when unsplit)."""
        return partial if self.shards is None else self.shards.all_reduce(partial)

    @staticmethod
    def _fused_layer(layer: _Layer, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                     meta: AttentionMetadata) -> None:
        """The layer on x [T, hidden] in place: norms and activation inside the products."""
        norms = layer.fused
        qkv = layer.qkv.fused(x, PROLOGUE_RMS_NORM, norms.input, norms.eps)
        layer.o_proj.fused(DirectForward._qkv_attention(layer, qkv, cos, signed_sin, meta), residual=x)
        gate_up = layer.gate_up.fused(x, PROLOGUE_RMS_NORM, norms.post, norms.eps)
        layer.down_proj.fused(gate_up, PROLOGUE_SILU_GATE, residual=x)

    @staticmethod
    def _attention(layer: _Layer, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        return layer.o_proj(DirectForward._qkv_attention(layer, layer.qkv(h), cos, signed_sin, meta))

    @staticmethod
    def _qkv_attention(layer: _Layer, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """The fused q/k/v product's rows [T, (H + 2 KVH) * Dh] -> attention output [T, H * Dh]."""
        tokens, heads, kv_heads = qkv.shape[0], layer.heads, layer.kv_heads
        qkv = qkv.view(tokens, heads + 2 * kv_heads, layer.head_dim)
        kernel = cpu_decode_attention() if meta.cpu_decode and layer.head_norms is None else None
        if kernel is not None and kernel.rotate_and_cache(qkv, heads, kv_heads, cos, signed_sin, meta.slot_mapping,
                                                          *meta.kv_cache.layer(layer.index)):
            out = attend_packed(layer.index, qkv[:, :heads], qkv[:, heads:heads + kv_heads],
                                qkv[:, heads + kv_heads:], meta, layer.attention, cached=True)
            return out.view(tokens, heads * layer.head_dim)
        qk = qkv[:, : heads + kv_heads]  # q and k heads side by side: rotated in one pass
        if layer.head_norms is not None:
            q_norm, k_norm = layer.head_norms
            qk = torch.cat((q_norm(qk[:, :heads]), k_norm(qk[:, heads:])), dim=1)
        qk = qk * cos + qk.roll(layer.head_dim // 2, -1) * signed_sin
        out = attend_packed(layer.index, qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :], meta,
                            layer.attention)
        return out.view(tokens, heads * layer.head_dim)

    @staticmethod
    def _mlp(layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate_up = layer.gate_up(h)
        return layer.down_proj(layer.act(gate_up[:, : layer.intermediate]) * gate_up[:, layer.intermediate :])


def direct_forward_for(model: nn.Module) -> DirectForward | None:
    """The direct forward of `model`, or None (logged) when it must run transformers'."""
    try:
        return DirectForward(model)
    except ValueError as exc:
        logger.info("transformers' forward: %s", exc)
        return None
