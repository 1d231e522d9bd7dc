"""KV pool sizing: the configured budget on CPU, the profiled arithmetic for a GPU."""

from __future__ import annotations

import pytest
import torch

from workers.contract.model_config import EngineConfig
from workers.core.limits import EngineLimits
from workers.engine.kv_sizing import (
    GIB,
    MemoryProfile,
    kv_budget_from_profile,
    resolve_kv_cache_bytes,
)


def test_budget_is_utilization_share_minus_usage_and_activation_peak():
    profile = MemoryProfile(total=80 * GIB, free=62 * GIB, peak_allocated=19 * GIB, allocated=16 * GIB + GIB // 4,
                            probe_cache=GIB // 4)
    # 72 GiB allowed - 18 GiB in use - 2.75 GiB activations + 0.25 GiB probe pool given back
    assert kv_budget_from_profile(profile, 0.9) == int(80 * GIB * 0.9) - 18 * GIB - (2 * GIB + 3 * GIB // 4) + GIB // 4


def test_with_nothing_else_on_the_device_it_is_total_times_utilization_minus_peak():
    weights = 3 * GIB
    profile = MemoryProfile(total=40 * GIB, free=40 * GIB - weights, peak_allocated=weights + GIB,
                            allocated=weights, probe_cache=0)
    assert kv_budget_from_profile(profile, 0.5) == 20 * GIB - (weights + GIB)


def test_no_room_left_raises_with_advice():
    profile = MemoryProfile(total=16 * GIB, free=GIB, peak_allocated=15 * GIB, allocated=14 * GIB, probe_cache=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_from_profile(profile, 0.9)


def test_cpu_uses_the_configured_budget_or_the_default():
    limits = EngineLimits()
    cpu = torch.device("cpu")
    assert resolve_kv_cache_bytes(EngineConfig(kv_cache_memory_gib=0.5), cpu, None, limits) == GIB // 2
    assert resolve_kv_cache_bytes(EngineConfig(), cpu, None, limits) == GIB
    # gpu_memory_utilization does not apply on CPU.
    assert resolve_kv_cache_bytes(EngineConfig(gpu_memory_utilization=0.1), cpu, None, limits) == GIB


def test_explicit_budget_wins_on_cuda_without_profiling():
    config = EngineConfig(kv_cache_memory_gib=8)
    # model=None: profiling would fail, so this proves no warm-up runs.
    assert resolve_kv_cache_bytes(config, torch.device("cuda"), None, EngineLimits()) == 8 * GIB


def test_utilization_is_validated():
    with pytest.raises(ValueError):
        EngineConfig(gpu_memory_utilization=0)
    with pytest.raises(ValueError):
        EngineConfig(gpu_memory_utilization=1.5)
