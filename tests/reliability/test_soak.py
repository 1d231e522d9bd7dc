"""A short soak (tools/reliability/soak.py) on the tiny model: mixed requests, nothing lost, and the
worker back to its baseline (no sequence, no referenced KV block) afterwards.
`make soak` runs the long one on the default model."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    delete_app,
    run_app,
    soak_app_args,
)
from tools.reliability.soak import (
    COMPLETED,
    KINDS,
    Malformed,
    ServeProbe,
    SoakConfig,
    StreamState,
    check_body,
    request_for,
    soak,
)

APP = "soak"


@pytest.fixture(scope="module")
def soak_app(serve_instance, tmp_path_factory):
    yield run_app(serve_instance, APP, soak_app_args(tmp_path_factory.mktemp("soak_model")))
    delete_app(APP)


def test_short_soak_loses_nothing_and_returns_to_baseline(soak_app):
    config = SoakConfig(url=soak_app, model=TINY_MODEL_ID, concurrency=12, duration_s=12, max_tokens=24,
                        request_timeout_s=120, settle_timeout_s=30)
    result = asyncio.run(soak(config, ServeProbe(APP, TINY_MODEL_ID)))
    print(result.summary())
    assert result.lost == 0, result.lost_details
    assert all(result.by_kind[kind].get(COMPLETED) for kind in KINDS), result.by_kind  # every kind ran
    assert result.completed >= 30  # (a random model seldom closes the forced call within max_tokens)
    # A clear error (a worker's 5xx or a 400) is not lost, but a healthy worker has none.
    assert result.failed == 0, result.failures
    assert result.before["kv_blocks_used"] == 0 and result.before["running"] == 0
    assert result.back_to_baseline, (result.before, result.after)
    assert result.after["kv_blocks_used"] == 0
    assert result.kills == 0 and result.resumes == 0  # read from the ingress's /metrics: no replica was lost


# ------------------------------------------------------------------ the classifier itself


def test_request_kinds_are_valid_requests():
    from serve_app.dialects.chat.request import ChatCompletionRequest
    from serve_app.dialects.completions import CompletionRequest
    from serve_app.ingress import parse_request

    rng = random.Random(0)
    for _ in range(5):
        for kind in KINDS:
            path, body = request_for(kind, "m", 16, rng)
            parse_request(CompletionRequest if path == "/v1/completions" else ChatCompletionRequest, body)


def test_a_stream_without_done_or_a_finish_is_not_complete():
    state = StreamState(n=2)
    state.feed('data: {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}]}')
    state.feed("data: [DONE]")
    assert not state.complete()  # choice 1 never finished
    with pytest.raises(Malformed):
        state.feed('data: {"choices": []}')  # nothing may follow [DONE]
    error = StreamState(n=1)
    error.feed('data: {"error": {"message": "boom", "code": "worker_failed"}}')
    error.feed("data: [DONE]")
    assert error.error == "worker_failed" and not error.complete()
    with pytest.raises(Malformed):
        StreamState(n=1).feed('data: {"error": {"code": "x"}}')  # an error needs a message


def test_a_body_must_have_every_choice_and_usage():
    body = {"n": 2}
    ok = {"choices": [{"index": i, "finish_reason": "stop", "message": {"content": "x"}} for i in range(2)],
          "usage": {"completion_tokens": 2}}
    assert check_body("/v1/chat/completions", body, ok) == (2, 0)
    with pytest.raises(Malformed):
        check_body("/v1/chat/completions", body, {**ok, "choices": ok["choices"][:1]})
    with pytest.raises(Malformed):
        check_body("/v1/chat/completions", body, {**ok, "usage": None})
    # Null content and no calls: only a cut forced call (finish_reason length) answers so.
    empty = [{"index": i, "finish_reason": "stop", "message": {"content": None}} for i in range(2)]
    with pytest.raises(Malformed):
        check_body("/v1/chat/completions", body, {**ok, "choices": empty})
    cut = [{**choice, "finish_reason": "length"} for choice in empty]
    assert check_body("/v1/chat/completions", body, {**ok, "choices": cut}) == (2, 0)
