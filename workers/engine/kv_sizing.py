"""How many bytes the KV pool gets: the configured budget, or on a GPU what a warm-up leaves.

On `device: cuda` (unless `engine.kv_cache_memory_gib` is set) the pool takes whatever
is left of `gpu_memory_utilization` of the device once the weights, the CUDA context,
other processes and the activations of the largest step are accounted for, as vLLM and
nano-vllm do: a warm-up step at `max_num_batched_tokens` runs on a small probe pool,
and the allocator's peak gives the activations. The arithmetic is a pure function
(`kv_budget_from_profile`), tested on CPU; the CUDA calls around it are thin.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from workers.contract.model_config import (
    CPU_DEFAULT_KV_CACHE_GIB,
    EngineConfig,
    ModelConfig,
)
from workers.contract.sampling_params import SamplingParams
from workers.core.limits import EngineLimits, engine_limits, model_window
from workers.engine.llm_engine import LLMEngine
from workers.model.kv_cache import KVCacheShape

GIB = 1024**3


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory in bytes, read right after the warm-up step."""

    total: int  # the device's memory
    free: int  # free on the device (allocator cache emptied): the rest is weights, context, others, probe
    peak_allocated: int  # torch's peak allocation during the warm-up
    allocated: int  # torch's allocation after it (weights + probe pool)
    probe_cache: int  # the probe pool, given back before the real pool is built


def kv_budget_from_profile(profile: MemoryProfile, utilization: float) -> int:
    """total × utilization − what is in use − the step's transient peak (+ the probe pool, which goes)."""
    used = profile.total - profile.free
    activations = profile.peak_allocated - profile.allocated
    budget = int(profile.total * utilization) - used - activations + profile.probe_cache
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {utilization:.0%} of {profile.total / GIB:.1f} GiB minus "
            f"{used / GIB:.1f} GiB in use and {activations / GIB:.1f} GiB of activations; raise "
            "engine.gpu_memory_utilization or lower engine.max_num_batched_tokens"
        )
    return budget


def cuda_graph_reserve(limits: EngineLimits, vocab_size: int) -> int:
    """Memory the decode CUDA graphs keep after capture, outside the profiled step: the
    float32 output buffer, and in their pool the largest graph's bf16/fp16 logits and
    their float32 copy (the activations of a decode step are far smaller; 256 MiB covers them)."""
    batch = min(limits.cuda_graph_max_batch, limits.max_num_seqs)
    if batch <= 0:
        return 0
    return batch * vocab_size * (4 + 2 + 4) + 256 * 1024**2


def sized_engine_limits(config: ModelConfig, model, device: torch.device) -> EngineLimits:
    """The engine limits `config` asks for, with the KV pool sized for `model` on `device`:
    what the worker builds its engine with (and the offline benchmarks, to match it)."""
    limits = engine_limits(config, model_window(model))
    return dataclasses.replace(limits, kv_cache_bytes=resolve_kv_cache_bytes(config.engine, device, model, limits))


def resolve_kv_cache_bytes(config: EngineConfig, device: torch.device, model, limits: EngineLimits) -> int:
    """The pool size for this worker: explicit, the CPU default, or profiled on the GPU
    (less what the decode CUDA graphs will keep)."""
    if config.kv_cache_memory_gib is not None:
        return int(config.kv_cache_memory_gib * GIB)
    if device.type != "cuda":
        return int(CPU_DEFAULT_KV_CACHE_GIB * GIB)
    budget = kv_budget_from_profile(profile_cuda_step(model, limits, device), config.gpu_memory_utilization)
    reserve = cuda_graph_reserve(limits, model.get_output_embeddings().weight.shape[0])
    if budget <= reserve:
        raise ValueError(f"no memory left for the KV cache after {reserve / GIB:.1f} GiB for CUDA graphs; lower "
                         "engine.cuda_graph_max_batch_size or raise engine.gpu_memory_utilization")
    return budget - reserve


@torch.inference_mode()
def profile_cuda_step(model, limits: EngineLimits, device: torch.device) -> MemoryProfile:
    """Run the largest step the scheduler can build (one prefill of the whole token budget,
    logits kept for every position as prompt_logprobs does) on a probe pool; read memory."""
    num_tokens = min(limits.max_num_batched_tokens, limits.max_model_len - 1)
    shape = KVCacheShape.from_model_config(model.config, model.dtype)
    blocks = -(-(num_tokens + 1) // limits.block_size)
    probe_bytes = blocks * limits.block_size * shape.bytes_per_token
    probe_limits = dataclasses.replace(limits, kv_cache_bytes=probe_bytes, enable_prefix_caching=False,
                                       cuda_graph_max_batch=0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    probe = LLMEngine(model, frozenset(), probe_limits, device)
    vocab = probe.vocab_size
    prompt = torch.randint(0, vocab, (num_tokens,)).tolist()
    probe.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=1))
    while probe.has_work():
        probe.step()
    torch.cuda.synchronize(device)
    peak, allocated = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryProfile(total, free, peak, allocated, probe.kv_cache.nbytes)
