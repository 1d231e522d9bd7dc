"""Serve's autoscaling policy on the engine's load: waiting sequences, KV-cache usage, queued prompt tokens.

Serve's controller runs it (`autoscaling_config.policy`, set from a model's
`deployment.autoscaling_config.engine_load`, workers/contract/model_config.py). It must
stay importable there: no torch, nothing of the engine, only the torch-free contract.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from workers.contract.engine_load import (
    KV_CACHE_USAGE,
    QUEUED_PROMPT_TOKENS,
    WAITING,
    EngineLoad,
)


class ScalingContext(Protocol):
    """What the policy reads of Serve's `AutoscalingContext`."""

    current_num_replicas: int  # running replicas
    target_num_replicas: int  # what the autoscaler aims at now (replicas may still be starting)
    capacity_adjusted_min_replicas: int
    capacity_adjusted_max_replicas: int
    aggregated_metrics: Mapping[str, Mapping[Any, float]] | None  # metric -> replica -> mean over the look-back


@dataclass(frozen=True)
class Targets:
    """Mean load per replica to scale towards; None: the signal is off."""

    waiting_per_replica: float | None
    kv_cache_usage: float | None
    queued_prompt_tokens_per_replica: float | None

    def load_ratio(self, load: EngineLoad) -> float:
        """The most loaded signal over its target (1.0: on target); 0.0 when every signal is idle."""
        pairs = ((load.waiting, self.waiting_per_replica), (load.kv_cache_usage, self.kv_cache_usage),
                 (load.queued_prompt_tokens, self.queued_prompt_tokens_per_replica))
        return max((value / target for value, target in pairs if target is not None), default=0.0)


def desired_replicas(ratio: float, running: int, target: int, margin: float, low: int, high: int) -> int:
    """Up when a signal is over its target: enough replicas to bring it back to target, at
    least one more. Down when every signal, spread over fewer replicas, would stay below
    (1 - margin) x its target. Else the current target, so a replica still starting keeps
    its place. Always within [low, high]."""
    wanted = target
    if ratio > 1:
        wanted = max(math.ceil(running * ratio), running + 1)
    elif (fewer := math.ceil(running * ratio / (1 - margin))) < running:
        wanted = fewer
    return max(low, min(high, wanted))


class EngineLoadPolicy:
    """The policy Serve calls once per control-loop tick. A class, so Serve builds it once with
    the config's targets (`policy_kwargs`). Serve then applies upscale_delay_s and
    downscale_delay_s to what it returns (a decision must hold that long) and the bounds again."""

    def __init__(self, waiting_per_replica: float | None = None, kv_cache_usage: float | None = None,
                 queued_prompt_tokens_per_replica: float | None = None, downscale_margin: float = 0.2) -> None:
        self.targets = Targets(waiting_per_replica, kv_cache_usage, queued_prompt_tokens_per_replica)
        self.downscale_margin = downscale_margin

    def __call__(self, ctx: ScalingContext) -> tuple[int, dict[str, Any]]:
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        running, metrics = ctx.current_num_replicas, ctx.aggregated_metrics or {}
        if running == 0 or not any(name in metrics for name in (WAITING, KV_CACHE_USAGE, QUEUED_PROMPT_TOKENS)):
            # Nothing reported yet (replicas starting; from zero Serve scales on requests itself): hold.
            return max(low, min(high, ctx.target_num_replicas)), {}
        ratio = self.targets.load_ratio(EngineLoad.mean_of(metrics, running))
        return desired_replicas(ratio, running, ctx.target_num_replicas, self.downscale_margin, low, high), {}
