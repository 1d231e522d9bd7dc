"""A tiny random Llama quantized into a GGUF file the way llama.cpp's converter writes it
(q/k rows interleaved per head, blocks of the chosen format), and its float twin: the
same model holding exactly the dequantized weights, as transformers would load them."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import torch

from tests.support.tiny_models import build_tiny_llama
from workers.model.fused_projections import fuse_sibling_projections

LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of q/k rows (transformers undoes it on load)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def quantized_llama(path: Path, fmt: gguf.GGMLQuantizationType, seed: int = 0, embedding_fmt=None,
                    **overrides) -> torch.nn.Module:
    """Write `path` (a GGUF of the tiny Llama's weights in `fmt`; the embedding in
    `embedding_fmt`, default `fmt`) and return the float twin, fused as the loader fuses."""
    model = build_tiny_llama(vocab_size=96, seed=seed, **overrides)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    tensors = [("token_embd.weight", model.model.embed_tokens, None, embedding_fmt or fmt)]
    if not config.tie_word_embeddings:
        tensors.append(("output.weight", model.lm_head, None, fmt))
    for index, layer in enumerate(model.model.layers):
        for module_path, name in LAYER_NAMES.items():
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(name)
            tensors.append((f"blk.{index}.{name}.weight", layer.get_submodule(module_path), heads, fmt))
    for name, module, heads, tensor_fmt in tensors:
        weight = module.weight.detach().float().numpy()
        stored = _llama_cpp_permute(weight, heads) if heads else weight
        blocks = gguf.quants.quantize(stored, tensor_fmt)
        dequantized = gguf.quants.dequantize(blocks, tensor_fmt).reshape(stored.shape)
        if heads:
            dequantized = _llama_cpp_permute_back(dequantized, heads)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(dequantized))
        writer.add_tensor(name, blocks, raw_dtype=tensor_fmt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fuse_sibling_projections(model)
    return model


def _llama_cpp_permute_back(weight: np.ndarray, heads: int) -> np.ndarray:
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def twin_pair(path: Path, fmt, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(float twin, a copy of it to swap the GGUF's blocks into)."""
    twin = quantized_llama(path, fmt, **kwargs)
    return twin, copy.deepcopy(twin)
