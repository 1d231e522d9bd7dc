"""Decode-only steps replayed from CUDA graphs captured at batch-size buckets.

A decode step of a small model on a big GPU is launch-bound: hundreds of small kernels,
each costing more on the host than on the device. Capturing the step once per batch
size and replaying it turns them into one launch. Graphs need fixed addresses and
shapes, so the step reads static input buffers (token ids, positions, KV slots, block
tables, context lengths) that each replay refills, and writes its float32 logits into
one static output buffer. A batch of n decodes runs the smallest captured size >= n;
the extra rows are padding: they write their K/V into a padding block of the cache that
no sequence owns, and attend to one slot of it.

With LoRA adapters, each size is captured twice: plain, and with the LoRA layers reading
each row's adapter slot from one more static input row (workers/lora/layers.py,
`LoraRowMask`), so one replay serves any mix of adapters and rows without one; a step
with no adapter row replays the plain graph and pays nothing for LoRA.

Attention inside the graph is the Triton paged kernel (its loop bound is each row's
context length, read on the device), so one graph serves every context length.
Prefill and mixed steps stay eager (their shapes vary with every chunk).
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext

import torch

from workers.core.adapter_slots import AdapterSlots, NoAdapters
from workers.core.batch import ScheduledChunk
from workers.model.attention import AttentionMetadata
from workers.model.kv_cache import PagedKVCache
from workers.model.step_inputs import decode_block_tables, decode_rows

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (as vLLM: padding wastes at most 15 rows)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, max_batch: int, max_model_len: int,
                 vocab_size: int, lora: AdapterSlots = NoAdapters()) -> None:
        if kv_cache.padding_block is None:
            raise ValueError("CUDA graphs need a KV cache with a padding block")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.sizes = graph_batch_sizes(max_batch)
        self.pad_block = kv_cache.padding_block
        self.pad_slot = kv_cache.padding_block * kv_cache.block_size
        device = kv_cache.keys.device
        width = -(-max_model_len // kv_cache.block_size)
        self.lora = lora
        no_adapter = lora.num_slots
        # Rows: token ids, positions, KV slots, context lengths, LoRA slots (max_loras: none);
        # one buffer, so one copy fills them.
        self.step_inputs = torch.tensor([[0], [0], [self.pad_slot], [1], [no_adapter]],
                                        device=device).repeat(1, max_batch)
        self.input_ids = self.step_inputs[0:1]  # [1, max_batch] views, as the model takes them
        self.positions = self.step_inputs[1:2]
        self.slots = self.step_inputs[2]
        self.context_lens = self.step_inputs[3]
        self.lora_slots = self.step_inputs[4]
        self.no_adapter = no_adapter
        self.block_tables = torch.full((max_batch, width), self.pad_block, dtype=torch.long, device=device)
        self.logits = torch.empty(max_batch, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch size, with LoRA)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.max_batch and bool(self.graphs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all sharing one memory pool (as vLLM does):
        each graph's activations are free again once it finishes."""
        start = time.perf_counter()
        pool = None
        variants = (False, True) if self.lora.num_slots else (False,)
        for size in reversed(self.sizes):
            for with_lora in variants:
                self._forward(size, with_lora)  # warm-up: cuBLAS handles, Triton compile, lazy inits
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(size, with_lora)
                pool = graph.pool()
                self.graphs[size, with_lora] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.graphs), self.sizes[0],
                    self.max_batch, time.perf_counter() - start)

    def _forward(self, size: int, with_lora: bool = False) -> None:
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=self.slots[:size],
            num_decode_tokens=size,
            decode_blocks=self.block_tables[:size],
            decode_mask=None,
            prefills=[],
            decode_context_lens=self.context_lens[:size],
            triton_decode=True,
        )
        dtype = self.model.get_input_embeddings().weight.dtype
        lora_rows = self.lora.graph_step(self.lora_slots[:size], dtype) if with_lora else nullcontext()
        with lora_rows:
            out = self.model(input_ids=self.input_ids[:, :size], position_ids=self.positions[:, :size],
                             attn_metadata=meta, logits_to_keep=0, use_cache=False)
        self.logits[:size].copy_(out.logits[0])

    def run(self, decodes: list[ScheduledChunk], token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Fill the static inputs (padding rows included, so no stale row writes a live
        slot) and replay the smallest graph that holds the batch. Returns a view of the
        output buffer: valid until the next replay. `token_ids` [n] on the device: the
        rows' input tokens, when the host does not have them yet (async scheduling)."""
        n = len(decodes)
        size = next(s for s in self.sizes if s >= n)
        pad = size - n
        ids, positions, slots = decode_rows(decodes, self.block_size, token_ids is None)
        ctx_lens = [p + 1 for p in positions]
        tables = decode_block_tables(decodes, ctx_lens, self.block_size, self.pad_block, rows=size)
        adapters = self.lora.row_slots(decodes)
        rows = [ids + [0] * pad, positions + [0] * pad, slots + [self.pad_slot] * pad, ctx_lens + [1] * pad,
                adapters + [self.no_adapter] * pad]
        self.step_inputs[:, :size].copy_(torch.tensor(rows), non_blocking=True)
        self.block_tables[:size, : tables.shape[1]].copy_(tables, non_blocking=True)
        if token_ids is not None:
            self.input_ids[0, :n].copy_(token_ids)
        self.graphs[size, any(a != self.no_adapter for a in adapters)].replay()
        return self.logits[:n]
