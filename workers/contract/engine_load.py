"""The engine load a worker replica reports to Serve's autoscaler, under names both ends share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# Custom autoscaling metrics (Serve's `record_autoscaling_stats`): the replica reports them,
# the controller averages each over `look_back_period_s`, the engine-load policy reads them.
WAITING = "chatserve_engine_waiting"
KV_CACHE_USAGE = "chatserve_engine_kv_cache_usage"
QUEUED_PROMPT_TOKENS = "chatserve_engine_queued_prompt_tokens"


@dataclass(frozen=True)
class EngineLoad:
    """One replica's load, or (in the policy) the mean load per replica of a deployment."""

    waiting: float  # requests' sequences the scheduler has not admitted yet
    kv_cache_usage: float  # share of the KV pool's blocks held by sequences, 0..1
    queued_prompt_tokens: float  # prompt tokens not yet prefilled (recomputation after preemption included)

    def as_metrics(self) -> dict[str, float]:
        return {WAITING: float(self.waiting), KV_CACHE_USAGE: float(self.kv_cache_usage),
                QUEUED_PROMPT_TOKENS: float(self.queued_prompt_tokens)}

    @classmethod
    def mean_of(cls, metrics: Mapping[str, Mapping[object, float]], replicas: int) -> EngineLoad:
        """The mean per replica of `metrics` (name -> replica -> value), over `replicas` replicas:
        a replica that has not reported yet counts as idle."""
        def mean(name: str) -> float:
            return sum(metrics.get(name, {}).values()) / replicas
        return cls(mean(WAITING), mean(KV_CACHE_USAGE), mean(QUEUED_PROMPT_TOKENS))
