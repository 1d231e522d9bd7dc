"""Prefix-aware routing through Serve: 2 worker replicas of the tiny model; a conversation's
next turn finds its last turn's prompt cached (it went to the same replica), and a load
with nothing shared is spread over both replicas."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from ray import serve

from serve_app.app import worker_deployment_name
from serve_app.transport.replica_directory import ReplicaDirectory, deployment_key
from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    delete_app,
    run_app,
    tiny_app_args,
)
from tests.support.tiny_models import write_tiny_model_dir

APP = "prefix"
SYSTEM = "You answer questions about the weather in short sentences. " * 2


@pytest.fixture(scope="module")
def two_replicas(serve_instance, tmp_path_factory):
    args = tiny_app_args(write_tiny_model_dir(tmp_path_factory.mktemp("model")), kv_cache_memory_gib=0.01)
    args["models"][0]["deployment"]["num_replicas"] = 2
    args["models"][0]["routing"] = {"block_chars": 32}
    yield run_app(serve_instance, APP, args)
    delete_app(APP)


def chat(url: str, messages: list[dict], **headers: str) -> dict:
    body = {"model": TINY_MODEL_ID, "messages": messages, "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def requests_per_replica() -> dict[str, int]:
    """Requests each replica ran, read from each one (the router's `replica=` pin)."""
    handle = serve.get_deployment_handle(worker_deployment_name(TINY_MODEL_ID), app_name=APP)
    handle.stats.remote().result()  # builds this process's router, which names the replicas
    replicas = ReplicaDirectory._replicas[deployment_key(APP, worker_deployment_name(TINY_MODEL_ID))]
    counts = {}
    for replica in replicas:
        stats = handle.stats.remote(replica=replica).result()
        counts[replica] = stats.requests_by_channel + stats.requests_by_call
    return counts


def test_next_turn_finds_the_last_turn_cached(two_replicas):
    for n in range(6):
        turn1 = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": f"Conversation {n}: is it raining in city number {n * 7}?"}]
        first = chat(two_replicas, turn1)
        turn2 = [*turn1, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And tomorrow?"}]
        second = chat(two_replicas, turn2)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        # Turn 1's prompt (but perhaps its last token, which the answer's text may merge
        # with) is cached only on the replica that ran turn 1; the other replica could hold
        # the system prompt at most.
        assert cached >= first["usage"]["prompt_tokens"] - 1, (n, cached, first["usage"])


def test_a_load_with_nothing_shared_is_spread(two_replicas):
    # Four at a time: one request after another leaves both replicas idle at every choice,
    # and Serve's ongoing counts (which the open channels add to) may then tie-break to one
    # replica each time; a load that overlaps must reach both.
    prompts = [[{"role": "user", "content": f"{n} " * (n + 1) + "unrelated question"}] for n in range(16)]
    before = requests_per_replica()
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda messages: chat(two_replicas, messages), prompts))
    after = requests_per_replica()
    ran = [after[r] - before.get(r, 0) for r in after]
    assert len(ran) == 2 and sum(ran) == 16
    assert min(ran) >= 2, ran


def test_a_session_stays_on_its_replica(two_replicas):
    before = requests_per_replica()
    for n in range(6):
        chat(two_replicas, [{"role": "user", "content": f"question {n} of one session"}], **{"x-session-id": "s-42"})
    after = requests_per_replica()
    assert sorted(after[r] - before.get(r, 0) for r in after) == [0, 6]
