"""Fuzzing through the real Serve HTTP path: 400 generated bodies (valid ones
from the request models' JSON schemas, mutated ones, broken JSON) on the tiny model.
None may get a 5xx or a malformed answer, the worker replica must not restart, and the
engine must end with no sequences left and its KV blocks free. `make fuzz` runs
thousands (tools/reliability/fuzz.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from serve_app.app import worker_deployment_name
from tests.support.serve_fixtures import TINY_MODEL_ID, worker_stats
from tools.reliability.fuzz_bodies import generate_cases
from tools.reliability.fuzz_harness import replica_actor_names, run_cases, wait_idle

# The session's app (an app deploy fewer): the cases must leave its engine clean (checked
# below), and the later tests on it (test_hostile_inputs.py) read nothing of its prefix cache.
APP = "tiny"
CASES = 400
SEED = 20261122


@pytest.fixture(scope="module")
def cases():
    return generate_cases(CASES, SEED, TINY_MODEL_ID)


def test_generated_bodies_get_no_5xx_and_leave_the_engine_clean(tiny_app, cases):
    stats = lambda: worker_stats(APP, TINY_MODEL_ID)  # noqa: E731
    before = wait_idle(stats)
    replicas = replica_actor_names(APP)
    assert any(worker_deployment_name(TINY_MODEL_ID) in name for name in replicas)

    report = run_cases(tiny_app, cases)

    assert len(report.outcomes) == CASES
    assert not report.problems, f"{len(report.problems)} problems, {report.statuses}:\n{report.describe_problems()}"
    assert report.statuses[200] >= CASES // 8, report.statuses  # enough bodies reach the engine
    assert replica_actor_names(APP) == replicas, "a replica was restarted"
    after = wait_idle(stats)
    assert after.pid == before.pid, "the worker process was replaced"
    assert (after.active_requests, after.running, after.waiting) == (0, 0, 0), after
    assert after.kv_blocks_used == before.kv_blocks_used == 0, after


def test_generation_is_deterministic_and_covers_every_route_and_kind(cases):
    assert cases == generate_cases(CASES, SEED, TINY_MODEL_ID)
    kinds = Counter(case.kind for case in cases)
    assert kinds["valid"] > 100
    assert {kind.split(":")[0] for kind in kinds} == {"valid", "mutate", "raw"}
    assert len(kinds) >= 20  # most of the 14 mutations and 9 raw kinds appear
    assert {case.route for case in cases} == {"/v1/chat/completions", "/v1/completions", "/lm/v2/chat/completions"}
