"""Faults: a worker replica killed mid-stream ends its streams with an error event, and
Serve's replacement serves the next request; under load, a killed worker replica fails only
its own requests and a killed ingress replica is replaced (serve_app/faults.py); an
exception in one request's sampling fails that request only, over HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import ray
from ray import serve

from serve_app.app import build_app, worker_deployment_name
from serve_app.app_config import parse_app_config
from serve_app.ingress import ChatIngress
from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    tiny_app_args,
    wait_ready,
    worker_stats,
)
from tools.reliability.faults import (
    INGRESS,
    FaultLoad,
    fault_app_args,
    fault_report,
    run_fault,
)
from tools.reliability.soak import Outcome, send
from workers.sampling.sampler import SamplingTensors
from workers.serving.deployment import ModelWorker

BODY = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "Hello"}], "ignore_eos": True}


@pytest.fixture(scope="module")
def fault_app(serve_instance, tiny_model_dir):
    serve.run(build_app(tiny_app_args(tiny_model_dir)), name="fault", route_prefix="/fault", blocking=False)
    url = serve_instance.url("/fault")
    wait_ready(url)
    yield url
    serve.delete("fault")


def kill_worker_replica() -> None:
    prefix = f"SERVE_REPLICA::fault#{worker_deployment_name(TINY_MODEL_ID)}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert names, "no worker replica found"
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


def test_killed_worker_ends_the_stream_with_an_error_then_recovers(fault_app):
    body = {**BODY, "max_tokens": 240, "stream": True}
    with httpx.stream("POST", fault_app + "/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        kill_worker_replica()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][6:])
    # 240 tokens take far longer than the kill: the stream ends with the error event.
    assert last["error"]["code"] == "worker_failed", last
    deadline = time.time() + 90
    while True:
        resp = httpx.post(fault_app + "/v1/chat/completions", json={**BODY, "max_tokens": 3}, timeout=30)
        if resp.status_code == 200:
            break
        assert resp.status_code in (500, 503), resp.text  # refused clearly while Serve replaces the replica
        assert time.time() < deadline, "the replacement replica never served"
        time.sleep(1)
    assert resp.json()["usage"]["completion_tokens"] == 3


def test_graceful_shutdown_lets_a_running_stream_finish(serve_instance, tiny_model_dir):
    import threading

    serve.run(build_app(tiny_app_args(tiny_model_dir)), name="drain", route_prefix="/drain", blocking=False)
    url = serve_instance.url("/drain")
    wait_ready(url)
    body = {**BODY, "max_tokens": 240, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        deleter = threading.Thread(target=serve.delete, args=("drain",))
        deleter.start()  # shutdown begins while the stream runs
        rest = [line for line in lines if line]
    deleter.join(timeout=60)
    assert rest[-1] == "data: [DONE]"
    finishes = [json.loads(line[6:])["choices"][0].get("finish_reason") for line in rest[:-1]
                if json.loads(line[6:]).get("choices")]
    assert finishes[-1] == "length"  # the whole answer, not an error


# ------------------------------------------------------------------ faults under load


@pytest.fixture(scope="module")
def two_replica_app(serve_instance, tiny_model_dir):
    """Two worker and two ingress replicas, so a kill can show that only the requests on
    the killed replica fail."""
    args = fault_app_args(tiny_app_args(tiny_model_dir), worker_replicas=2, ingress_replicas=2)
    serve.run(build_app(args), name="faults2", route_prefix="/faults2", blocking=False)
    url = serve_instance.url("/faults2")
    wait_ready(url)
    yield url
    serve.delete("faults2")


def fault_load(url: str) -> FaultLoad:
    # 200 tokens a stream: several seconds each on the tiny model at concurrency 8, so the
    # kill lands with streams in flight on both replicas.
    return FaultLoad(url=url, model=TINY_MODEL_ID, concurrency=8, max_tokens=200, kill_after_s=4,
                     run_after_s=12, request_timeout_s=60)


def test_a_killed_worker_replica_fails_only_its_own_requests(two_replica_app):
    report = run_fault("kill worker replica", "faults2", worker_deployment_name(TINY_MODEL_ID),
                       fault_load(two_replica_app))
    print(report.line())
    assert report.replicas == 2 and report.in_flight_at_kill >= 6
    # The other replica's streams finish; the killed one's end with a clear error.
    assert 0 < report.affected < report.in_flight_at_kill
    assert report.affected_lost == 0 and report.affected == report.affected_failed, report.errors
    assert all("worker_failed" in error for error in report.errors), report.errors
    assert report.recovery_s is not None and report.recovery_s < 10
    assert report.replaced_s is not None


def test_a_killed_ingress_replica_cuts_only_its_own_streams(two_replica_app):
    report = run_fault("kill ingress replica", "faults2", INGRESS, fault_load(two_replica_app))
    print(report.line())
    assert report.replicas == 2 and report.in_flight_at_kill >= 6
    # Its streams lose their connection (the process that wrote them is gone: nothing can
    # send an error event); the other replica's streams finish.
    assert 0 < report.affected < report.in_flight_at_kill
    assert report.recovery_s is not None and report.recovery_s < 30
    assert report.replaced_s is not None
    assert report.failed_after_kill == 0, report.errors


# ------------------------------------------------------------------ an exception in one request's sampling

POISON_SEED = 666  # the request whose sampling raises


@serve.deployment(name="ModelWorker")
class PoisonedWorker(ModelWorker.func_or_class):
    """The model worker, except that building sampling tensors for a batch that holds a
    request with seed POISON_SEED past its second token raises (in this replica's process
    only): the request has begun, so a stream reports the error in-band."""

    def __init__(self, model_config: dict) -> None:
        super().__init__(model_config)
        build = SamplingTensors.from_sequences.__func__

        def poisoned(cls, seqs, vocab_size, device):
            if any(s.params.seed == POISON_SEED and s.num_output_tokens >= 2 for s in seqs):
                raise RuntimeError("injected sampling failure")
            return build(cls, seqs, vocab_size, device)

        SamplingTensors.from_sequences = classmethod(poisoned)


@pytest.fixture(scope="module")
def poisoned_app(serve_instance, tiny_model_dir):
    config = parse_app_config(tiny_app_args(tiny_model_dir))
    model = config.models[0]
    worker = PoisonedWorker.options(name=worker_deployment_name(model.id), **model.deployment.serve_options())
    app = ChatIngress.options(**config.ingress.serve_options()).bind(
        config.model_dump(), {model.id: worker.bind(model.model_dump())})
    serve.run(app, name="poison", route_prefix="/poison", blocking=False)
    url = serve_instance.url("/poison")
    wait_ready(url)
    yield url
    serve.delete("poison")


def greedy_requests() -> list[dict]:
    prompts = ["Hello", "Paris is", "def add(a, b):", "Tell me a story", "The quick brown fox", "Hi there"]
    return [{**BODY, "messages": [{"role": "user", "content": p}], "max_tokens": 24, "temperature": 0,
             "stream": i % 2 == 1} for i, p in enumerate(prompts)]


async def post_all(url: str, bodies: list[dict]) -> list[Outcome]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(send(client, url, "chat", "/v1/chat/completions", b, 0) for b in bodies))


def chat_text(url: str, body: dict) -> str:
    resp = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def test_an_exception_in_one_requests_sampling_fails_that_request_only(poisoned_app):
    bodies = greedy_requests()
    expected = [chat_text(poisoned_app, b) for b in bodies]  # fault-free, one at a time
    poison = {**BODY, "max_tokens": 24, "temperature": 1.0, "seed": POISON_SEED}
    # Non-streaming: a 500 JSON error; streaming (200 already sent): an SSE error event.
    for stream, status in ((False, 500), (True, 200)):
        outcomes = asyncio.run(post_all(poisoned_app, [*bodies, {**poison, "stream": stream}]))
        *good, bad = outcomes
        assert (bad.result, bad.status, bad.detail) == ("failed", status, "engine_error")
        assert [o.result for o in good] == ["completed"] * len(bodies), [o.detail for o in good]
    # The others' greedy outputs are exactly those of the fault-free run.
    assert [chat_text(poisoned_app, b) for b in bodies] == expected
    after = asyncio.run(post_all(poisoned_app, bodies))
    assert all(o.result == "completed" for o in after)
    stats = worker_stats("poison", TINY_MODEL_ID)
    assert stats.running == stats.waiting == stats.active_requests == stats.kv_blocks_used == 0


def test_fault_report_counts_only_requests_in_flight_at_the_kill():
    def outcome(result: str, started: float, latency: float) -> Outcome:
        return Outcome("chat_stream", result, 200, started=started, latency_s=latency)

    load = [outcome("completed", 0, 5), outcome("failed", 8, 4), outcome("lost", 9, 2),
            outcome("completed", 9, 3), outcome("completed", 11, 1), outcome("failed", 12, 0.1)]
    probes = [outcome("failed", 10.5, 0.1), outcome("completed", 11, 2), outcome("completed", 9, 0.5)]
    report = fault_report("kill", 2, load, probes, killed_at=10.0, replaced_s=20.0)
    assert (report.in_flight_at_kill, report.affected, report.affected_failed, report.affected_lost) == (3, 2, 1, 1)
    assert (report.sent_after_kill, report.failed_after_kill) == (2, 1)
    assert report.recovery_s == 3.0  # the first probe sent after the kill that succeeded ended at 13
