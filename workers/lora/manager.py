"""One engine's LoRA state: the model's target layers wrapped, the adapters registered, the
slots they occupy, and each step's rows by adapter.

Runs on the engine thread (the scheduler admits and releases through it, the model runner
asks it for a step's runs); `check` reads only fixed shapes, so any thread may call it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from workers.contract.lora import LoraAdapterError
from workers.core.batch import ScheduledChunk
from workers.core.limits import LoraLimits
from workers.core.sequence import Sequence
from workers.lora.layers import (
    GroupedRuns,
    LoraContext,
    LoraLinear,
    LoraRowMask,
    LoraSegments,
)
from workers.lora.peft_files import LoraAdapter, LoraModule
from workers.lora.slots import LoraSlots
from workers.model.cpu_linear import PackedLinear
from workers.model.fused_projections import ProjectionSlice
from workers.quant.quantized_layers import DeviceQuantizedLinear, QuantizedLinear

# The attention and MLP projections of Llama-style decoders (Llama, Mistral, Qwen2/3,
# Gemma, SmolLM, ...): what PEFT's usual target_modules name, and what chatserve adapts.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraTarget:
    layer: LoraLinear
    part: int  # which of the layer's parts (its sibling index in a fused projection)

    @property
    def shape(self) -> tuple[int, int]:
        start, end = self.layer.bounds[self.part]
        return end - start, self.layer.in_features


class ModelPart(Protocol):
    """One shard's part of a split model, as its LoRA layers see it (workers/parallel/lora_split.py)."""

    def part(self, adapter: LoraAdapter) -> LoraAdapter:
        """The adapter of the whole model cut to this shard's part of its layers."""

    def holds(self, module: str) -> bool:
        """Whether this shard holds the layer of `module` (a pipeline stage holds its own)."""

    def expected(self, module: str) -> tuple[int, int] | None:
        """A target layer's (out, in) features in a shard's part; None: no target."""


class LoraManager:
    """The engine's AdapterSlots (workers/core/adapter_slots.py) when the model serves adapters."""

    def __init__(self, model: nn.Module, limits: LoraLimits, split: ModelPart | None = None) -> None:
        """`split`: `model` is one shard's part of a split model (workers/parallel/lora_split.py)."""
        self.limits = limits
        self.split = split
        # Called with the whole adapter each time one is written into a slot (the driver of
        # a split model passes it on to the other shards, which write their parts).
        self.on_load: Callable[[int, LoraAdapter], None] | None = None
        self.context = LoraContext()
        self.targets = wrap_targets(model, limits, self.context, split.holds if split is not None else None)
        if not self.targets:
            raise ValueError(f"the model has no LoRA target layer ({', '.join(LORA_TARGETS)})")
        self.slots = LoraSlots(limits.max_loras)
        self.adapters: dict[str, LoraAdapter] = {}  # registered, by key

    @property
    def num_slots(self) -> int:
        return self.limits.max_loras

    # --- adapters ---------------------------------------------------------------------

    def check(self, adapter: LoraAdapter) -> None:
        """Raise LoraAdapterError (naming the adapter) unless every module it adapts is a
        target of this model with matching shapes, within the rank limit."""
        if adapter.rank > self.limits.max_rank:
            raise LoraAdapterError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} is above this model's "
                                   f"max_lora_rank {self.limits.max_rank}")
        for module, weights in self._part_of(adapter).modules.items():
            target = self.targets.get(module)
            shape = target.shape if target is not None else self._elsewhere(module)
            if shape is None:
                raise LoraAdapterError(f"LoRA adapter {adapter.name!r} adapts {module!r}, which is not a LoRA "
                                       f"target of this model (its attention and MLP projections: "
                                       f"{', '.join(LORA_TARGETS)})")
            out_features, in_features = shape
            if weights.a.shape[1] != in_features or weights.b.shape[0] != out_features:
                raise LoraAdapterError(
                    f"LoRA adapter {adapter.name!r}: {module!r} maps {weights.a.shape[1]} -> {weights.b.shape[0]} "
                    f"features, the model's layer {in_features} -> {out_features} (another base model?)")

    def add(self, adapter: LoraAdapter) -> None:
        """Register `adapter` for new requests; the caller has checked it (`check`)."""
        self.adapters[adapter.key] = adapter

    def remove(self, key: str) -> bool:
        """Forget `key` for new requests. Its running and waiting requests keep it (they hold
        the weights); its slot is reused when it is the least recently used idle one."""
        return self.adapters.pop(key, None) is not None

    def get(self, key: str) -> LoraAdapter:
        adapter = self.adapters.get(key)
        if adapter is None:
            raise LoraAdapterError(f"LoRA adapter {key!r} is not loaded on this worker")
        return adapter

    # --- slots (the scheduler's side) ---------------------------------------------------

    def admit(self, seq: Sequence) -> bool:
        """Give `seq` its adapter's slot, writing the weights in if the slot held another;
        False when every slot is held by running sequences (the sequence waits)."""
        grant = self.slots.acquire(seq.lora.key)
        if grant is None:
            return False
        if grant.needs_load:
            self._load(grant.slot, seq.lora)
        seq.lora_slot = grant.slot
        return True

    def share(self, parent: Sequence, child: Sequence) -> None:
        """A fork runs on its parent's slot."""
        if parent.lora_slot is not None:
            self.slots.acquire(parent.lora.key)
            child.lora_slot = parent.lora_slot

    def release(self, seq: Sequence) -> None:
        if seq.lora_slot is not None:
            self.slots.release(seq.lora.key)
            seq.lora_slot = None

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        if self.on_load is not None:
            self.on_load(slot, adapter)
        self.load_slot(slot, adapter)

    def load_slot(self, slot: int, adapter: LoraAdapter) -> None:
        """Write `adapter` (of the whole model: cut here when this is a part) into `slot`."""
        by_layer: dict[LoraLinear, dict[int, LoraModule]] = {}
        for module, weights in self._part_of(adapter).modules.items():
            target = self.targets.get(module)
            if target is not None:  # else a layer of another pipeline stage
                by_layer.setdefault(target.layer, {})[target.part] = weights
        for layer in dict.fromkeys(t.layer for t in self.targets.values()):
            parts = by_layer.get(layer, {})
            layer.load_slot(slot, {p: (w.a, w.b) for p, w in parts.items()})

    def _part_of(self, adapter: LoraAdapter) -> LoraAdapter:
        return adapter if self.split is None else self.split.part(adapter)

    def _elsewhere(self, module: str) -> tuple[int, int] | None:
        """The part's (out, in) of a target layer another pipeline stage holds; None when
        `module` is no target of the model."""
        if self.split is None or self.split.holds(module):
            return None
        return self.split.expected(module)

    # --- steps (the model runner's side) --------------------------------------------------

    @staticmethod
    def decode_order(decodes: list[ScheduledChunk]) -> list[int] | None:
        """The decode rows sorted by slot (stable), so each adapter's rows are one run;
        None when no decode has an adapter or they are in order already."""
        slots = [_slot_key(c.seq) for c in decodes]
        order = sorted(range(len(slots)), key=slots.__getitem__)
        if order == list(range(len(slots))) or all(c.seq.lora_slot is None for c in decodes):
            return None
        return order

    @staticmethod
    def segments(decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]) -> LoraSegments | None:
        """Runs of packed rows sharing an adapter (decodes first, one row each, sorted by
        slot; then each prefill chunk), the decode runs grouped where that pays; None when
        no row has an adapter."""
        decode_runs = _runs(decodes, 0)
        prefill_runs = _runs(prefills, sum(c.num_tokens for c in decodes))
        if not decode_runs and not prefill_runs:
            return None
        grouped = GroupedRuns.of(decode_runs)
        return LoraSegments(tuple(prefill_runs if grouped else decode_runs + prefill_runs), grouped)

    def step(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]) -> AbstractContextManager:
        """The step's adapter runs set in the LoRA layers while the model runs."""
        return self.context.active(self.segments(decodes, prefills))

    def graph_step(self, slot_row: torch.Tensor, dtype: torch.dtype) -> AbstractContextManager:
        """The LoRA layers' step inside a CUDA graph: each row's slot one-hot, computed on the
        device from the graph's slot-index input row (a padding row's `num_slots` matches none)."""
        slots = torch.arange(self.num_slots, device=slot_row.device)
        return self.context.active(LoraRowMask((slot_row.unsqueeze(1) == slots).to(dtype)))

    def row_slots(self, decodes: list[ScheduledChunk]) -> list[int]:
        """Each decode's slot, `max_loras` for none (a CUDA graph's slot-index input)."""
        none = self.limits.max_loras
        return [none if c.seq.lora_slot is None else c.seq.lora_slot for c in decodes]


def _runs(chunks: list[ScheduledChunk], row: int) -> list[tuple[int, int, int]]:
    """(slot, first row, end row) of each run of consecutive chunks with one adapter, packed from `row`."""
    runs: list[tuple[int, int, int]] = []
    for chunk in chunks:
        slot, end = chunk.seq.lora_slot, row + chunk.num_tokens
        if slot is not None:
            if runs and runs[-1][0] == slot and runs[-1][2] == row:
                runs[-1] = (slot, runs[-1][1], end)
            else:
                runs.append((slot, row, end))
        row = end
    return runs


def _slot_key(seq: Sequence) -> int:
    return -1 if seq.lora_slot is None else seq.lora_slot


def wrap_targets(model: nn.Module, limits: LoraLimits, context: LoraContext,
                 holds: Callable[[str], bool] | None = None) -> dict[str, LoraTarget]:
    """Wrap each target projection of the model's language model in a LoraLinear, in place
    (a fused group once, its siblings as parts); returns the targets by module path. A
    model an earlier engine wrapped (the GPU's memory-profiling engine, tests, benchmarks)
    keeps its layers when their shape fits, now answering to `context` (the earlier engine
    must not step again: one live engine a model)."""
    dtype, device = _dtype_device(model)
    targets: dict[str, LoraTarget] = {}
    modules = dict(model.named_modules())

    def layer(current: nn.Module, bounds: list[tuple[int, int]]) -> LoraLinear:
        if isinstance(current, LoraLinear):
            if (current.num_slots, current.rank) == (limits.max_loras, limits.max_rank):
                current.context = context  # its slots are written before any use: stale values never show
                return current
            current = current.base
        return LoraLinear(current, bounds, limits.max_loras, limits.max_rank, context, dtype, device)

    for name in _language_model_names(model, modules):
        module = modules[name]
        if name.rsplit(".", 1)[-1] not in LORA_TARGETS or (holds is not None and not holds(name)):
            continue
        if isinstance(module, ProjectionSlice):
            fused = module.fused
            if not (isinstance(fused.linear, LoraLinear) and fused.linear.context is context):  # once a group
                fused.linear = layer(fused.linear, fused.bounds)
            targets[name] = LoraTarget(fused.linear, module.index)
        elif type(module) in (nn.Linear, PackedLinear, QuantizedLinear, DeviceQuantizedLinear, LoraLinear):
            wrapped = layer(module, [(0, module.out_features)])
            parent_name, _, child = name.rpartition(".")
            setattr(modules[parent_name] if parent_name else model, child, wrapped)
            targets[name] = LoraTarget(wrapped, 0)
    return targets


def _language_model_names(model: nn.Module, modules: dict[str, nn.Module]) -> list[str]:
    """Module paths inside the language model (a vision tower's projections are not adapted)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    prefix = next((n for n, m in modules.items() if m is decoder), None) if decoder is not None else None
    if not prefix:
        return list(modules)
    return [n for n in modules if n.startswith(prefix + ".")]


def _dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The model's dtype and device, from its input embedding; on a later pipeline stage,
    which holds none (it stays on the meta device), from a weight the stage holds (a norm:
    packed CPU linears keep a meta weight too)."""
    weight = model.get_input_embeddings().weight
    if weight.is_meta:
        weight = next(p for name, p in model.named_parameters() if "norm" in name and not p.is_meta)
    return weight.dtype, weight.device
