"""The engine-load autoscaling policy on a fake Serve context (no Ray): up on any signal, down on all, bounds."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from workers.contract.engine_load import (
    KV_CACHE_USAGE,
    QUEUED_PROMPT_TOKENS,
    WAITING,
    EngineLoad,
)
from workers.serving.engine_load_policy import (
    EngineLoadPolicy,
    Targets,
    desired_replicas,
)


@dataclass
class FakeContext:
    """The fields of Serve's AutoscalingContext the policy reads."""

    current_num_replicas: int
    target_num_replicas: int
    aggregated_metrics: dict | None = field(default_factory=dict)
    capacity_adjusted_min_replicas: int = 1
    capacity_adjusted_max_replicas: int = 4


def reported(*loads: EngineLoad) -> dict:
    """What Serve's controller hands the policy: metric -> replica -> mean over the look-back."""
    metrics: dict = {}
    for replica, load in enumerate(loads):
        for name, value in load.as_metrics().items():
            metrics.setdefault(name, {})[f"replica-{replica}"] = value
    return metrics


POLICY = {"waiting_per_replica": 2, "kv_cache_usage": 0.8, "queued_prompt_tokens_per_replica": 1000,
          "downscale_margin": 0.2}
IDLE = EngineLoad(0, 0.0, 0)


def decide(*loads: EngineLoad, running: int | None = None, target: int | None = None, **bounds) -> int:
    running = len(loads) if running is None else running
    ctx = FakeContext(running, running if target is None else target, reported(*loads), **bounds)
    replicas, state = EngineLoadPolicy(**POLICY)(ctx)
    assert state == {}
    return replicas


@pytest.mark.parametrize("load", [EngineLoad(3, 0.1, 0), EngineLoad(0, 0.9, 0), EngineLoad(0, 0.1, 1500)],
                         ids=["waiting", "kv_cache", "queued_tokens"])
def test_any_signal_over_its_target_adds_a_replica(load):
    # One long prompt on one replica: a single request, but its KV use or its prefill is the load.
    assert decide(load) == 2


def test_far_over_target_adds_enough_replicas_for_the_target_within_max():
    # 8 waiting a replica, target 2: 2 x 4 replicas
    assert decide(EngineLoad(7, 0.5, 0), EngineLoad(9, 0.5, 0), capacity_adjusted_max_replicas=10) == 8
    assert decide(EngineLoad(7, 0.5, 0), EngineLoad(9, 0.5, 0), capacity_adjusted_max_replicas=3) == 3


def test_near_target_holds():
    # All under target, but on one replica fewer the KV cache would be over 0.8 x (1 - 0.2).
    assert decide(EngineLoad(1, 0.5, 100), EngineLoad(1, 0.4, 100)) == 2
    assert decide(EngineLoad(2, 0.8, 1000)) == 1  # exactly on target: no change


def test_removes_replicas_only_when_every_signal_is_under_target_by_the_margin():
    assert decide(EngineLoad(0, 0.2, 0), EngineLoad(0, 0.1, 0)) == 1  # 0.3 on one replica < 0.64
    assert decide(EngineLoad(0, 0.2, 0), EngineLoad(0, 0.1, 1400)) == 2  # the queued tokens would be 1400 > 800
    assert decide(IDLE, IDLE, IDLE) == 1


def test_respects_min_replicas_and_scales_to_zero_only_when_allowed():
    assert decide(IDLE, IDLE, capacity_adjusted_min_replicas=2) == 2
    assert decide(IDLE, capacity_adjusted_min_replicas=0) == 0


def test_a_replica_still_starting_keeps_its_place():
    # 1 running, 2 targeted (one starting): the load still over target asks for no third one...
    assert decide(EngineLoad(3, 0.5, 0), target=2) == 2
    # ... and a load between the thresholds does not take the starting one away.
    assert decide(EngineLoad(1, 0.7, 0), target=2) == 2


def test_a_replica_that_has_not_reported_counts_as_idle():
    metrics = reported(EngineLoad(6, 0.9, 0))  # one report, two replicas running: 3 waiting a replica
    replicas, _ = EngineLoadPolicy(**POLICY)(FakeContext(2, 2, metrics))
    assert replicas == 3


@pytest.mark.parametrize("metrics", [None, {}, {"some_other_metric": {"r": 5.0}}])
def test_without_engine_reports_it_holds_the_current_target(metrics):
    ctx = FakeContext(current_num_replicas=2, target_num_replicas=3, aggregated_metrics=metrics)
    assert EngineLoadPolicy(**POLICY)(ctx) == (3, {})
    assert EngineLoadPolicy(**POLICY)(FakeContext(0, 1, reported(IDLE))) == (1, {})  # from zero: Serve's own path


def test_signals_turned_off_are_ignored():
    only_kv = EngineLoadPolicy(kv_cache_usage=0.5)
    load = reported(EngineLoad(50, 0.1, 10_000))
    assert only_kv(FakeContext(2, 2, {KV_CACHE_USAGE: load[KV_CACHE_USAGE]})) == (1, {})
    assert only_kv(FakeContext(1, 1, {WAITING: load[WAITING], QUEUED_PROMPT_TOKENS: load[QUEUED_PROMPT_TOKENS]})) \
        == (1, {})
    assert Targets(None, None, None).load_ratio(EngineLoad(5, 1.0, 5)) == 0.0


def test_desired_replicas_arithmetic():
    assert desired_replicas(1.01, running=3, target=3, margin=0.2, low=1, high=10) == 4  # at least one more
    assert desired_replicas(2.5, running=2, target=2, margin=0.2, low=1, high=10) == 5
    assert desired_replicas(0.5, running=4, target=4, margin=0.2, low=1, high=10) == 3  # ceil(4 x 0.5 / 0.8)
    assert desired_replicas(0.5, running=4, target=4, margin=0.0, low=1, high=10) == 2
    assert desired_replicas(0.0, running=4, target=4, margin=0.2, low=1, high=10) == 1
