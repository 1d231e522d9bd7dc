"""A model split under Serve (workers/parallel/: parallel.tensor_parallel_size: 2, and two
pipeline stages of two tensor shards each): each replica's shards sit in its placement
group; the OpenAI client streams the same greedy text as the whole model gives, and a LoRA
adapter's tokens equal peft's merged model's; a shard killed mid-stream ends its replica,
and the stream resumes on the other replica (or on Serve's replacement) with no request
failed."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import openai
import pytest
from ray import serve

from serve_app.app import build_app
from tests.support.engines import template_ids
from tests.support.lora_adapters import merged_greedy, merged_model, write_peft_adapter
from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    delete_app,
    tiny_app_args,
    wait_ready,
)
from tools.procfs import process_ids, read_text

MESSAGES = [{"role": "user", "content": "Hello there"}]


def split_args(model_dir, tensor_parallel_size: int, replicas: int, stages: int = 1) -> dict:
    args = tiny_app_args(model_dir)
    model = args["models"][0]
    model["parallel"] = {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": stages}
    # One CPU a replica, split over its shards: the placement-group path.
    model["deployment"] = {**model["deployment"], "num_replicas": replicas, "ray_actor_options": {"num_cpus": 1}}
    return args


@pytest.fixture(scope="module")
def apps(serve_instance, tiny_model_dir, tiny_app):
    """The split app, and the session's app on the same model whole (`tiny_app`)."""
    serve.run(build_app(split_args(tiny_model_dir, 2, 2)), name="split", route_prefix="/split", blocking=False)
    url = serve_instance.url("/split")
    wait_ready(url, timeout=240)
    yield {"split": url, "whole": tiny_app}
    delete_app("split")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=180, max_retries=0)


def streamed_text(url: str, max_tokens: int, on_first=None) -> tuple[str, str | None]:
    stream = client(url).chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=max_tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
    parts, finish = [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        if on_first is not None and parts:
            on_first()
            on_first = None
        parts.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


def shard_pids() -> list[int]:
    """The shard actors' processes (Ray titles them ray::ShardActor...)."""
    return [pid for pid in process_ids() if read_text(f"/proc/{pid}/cmdline").startswith("ray::ShardActor")]


def test_the_split_model_streams_the_whole_models_text(apps):
    assert len(shard_pids()) == 2  # one shard beside each of the two replicas
    want, _ = streamed_text(apps["whole"], 40)
    got, finish = streamed_text(apps["split"], 40)
    assert got == want and finish == "length"


def resumed(url: str) -> float:
    """The app's chatserve_requests_resumed_total (requests moved to another replica)."""
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("chatserve_requests_resumed_total"))


def test_a_model_in_two_stages_of_two_tensor_shards_streams_the_whole_models_text(
        serve_instance, tiny_model_dir, tiny_app, tiny_model, tiny_tokenizer, tmp_path):
    """The same app serves a LoRA adapter: each shard holds its cut of it."""
    args = split_args(tiny_model_dir, 2, 1, stages=2)
    adapter = write_peft_adapter(tiny_model, tmp_path / "adapter", seed=31)
    args["models"][0]["lora"] = {"adapters": {"adapter": str(adapter)}, "max_loras": 1, "max_lora_rank": 4}
    serve.run(build_app(args), name="stages", route_prefix="/stages", blocking=False)
    url = serve_instance.url("/stages")
    try:
        wait_ready(url, timeout=240)
        want, _ = streamed_text(tiny_app, 40)
        got, finish = streamed_text(url, 40)
        assert got == want and finish == "length"
        reply = client(url).chat.completions.create(model="adapter", messages=MESSAGES, max_tokens=6, temperature=0,
                                                    logprobs=True, extra_body={"ignore_eos": True})
        merged = merged_greedy(merged_model(tiny_model, adapter), template_ids(tiny_tokenizer, MESSAGES[0]["content"]),
                               6)
        assert [t.token for t in reply.choices[0].logprobs.content] == [tiny_tokenizer.decode([t]) for t in merged]
    finally:
        delete_app("stages")


def test_a_shard_killed_mid_stream_fails_no_request(apps):
    want, _ = streamed_text(apps["whole"], 200)
    deadline = time.monotonic() + 60
    while len(shard_pids()) > 2:  # an app deleted just before may still be stopping its shards
        assert time.monotonic() < deadline, "another app's shards outlived it"
        time.sleep(0.5)
    before, resumes = shard_pids(), resumed(apps["split"])

    def kill_shards() -> None:
        for pid in before:
            with contextlib.suppress(ProcessLookupError):  # gone already: nothing to kill
                os.kill(pid, signal.SIGKILL)

    got, finish = streamed_text(apps["split"], 200, on_first=kill_shards)
    assert got == want and finish == "length"
    assert resumed(apps["split"]) > resumes  # the kill landed mid-stream: the request moved
    deadline = time.monotonic() + 120
    while len(shard_pids()) < 2 or set(shard_pids()) & set(before):
        assert time.monotonic() < deadline, "Serve did not replace the replicas whose shards died"
        time.sleep(1)
