"""The KV tensors: one pool of token slots per layer, sized from a memory budget.

Layout per layer: key and value tensors of shape [num_slots, num_kv_heads, head_dim].
A slot holds exactly one token's K and V, so memory per token is the theoretical
2 * layers * kv_heads * head_dim * dtype bytes, with no padding to a maximum length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model_config(cls, config, dtype: torch.dtype) -> "KVCacheShape":
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        return cls(text_config.num_hidden_layers, kv_heads, head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    def num_blocks_for_budget(self, budget_bytes: int, block_size: int) -> int:
        return budget_bytes // (self.bytes_per_token * block_size)


class PagedKVCache:
    def __init__(self, shape: KVCacheShape, num_blocks: int, block_size: int, device: torch.device,
                 padding_block: bool = False) -> None:
        """`padding_block`: one more block, owned by no sequence, that the padding rows of a
        CUDA graph write to (block id `num_blocks`)."""
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.padding_block = num_blocks if padding_block else None
        num_slots = (num_blocks + int(padding_block)) * block_size
        dims = (shape.num_layers, num_slots, shape.num_kv_heads, shape.head_dim)
        self.keys = torch.zeros(dims, dtype=shape.dtype, device=device)
        self.values = torch.zeros(dims, dtype=shape.dtype, device=device)
        # Each layer's views made once: a step asks for them twice a layer (a select each)
        self._layers = [(self.keys[i], self.values[i]) for i in range(shape.num_layers)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers) for copy-on-write: [(source, destination), ...]."""
        if not pairs:
            return
        bs = self.block_size
        src = torch.tensor([s * bs + i for s, _ in pairs for i in range(bs)], device=self.keys.device)
        dst = torch.tensor([d * bs + i for _, d in pairs for i in range(bs)], device=self.keys.device)
        self.keys[:, dst] = self.keys[:, src]
        self.values[:, dst] = self.values[:, src]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[layer_idx]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes
