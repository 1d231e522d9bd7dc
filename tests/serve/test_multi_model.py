"""Two models behind one ingress, routed by the request's `model`."""

from __future__ import annotations

import httpx
import pytest
from ray import serve

from serve_app.app import build_app
from tests.support.serve_fixtures import delete_app, tiny_app_args, wait_ready
from tests.support.tiny_models import write_tiny_model_dir


@pytest.fixture(scope="module")
def two_models(serve_instance, tmp_path_factory):
    args = tiny_app_args(write_tiny_model_dir(tmp_path_factory.mktemp("model_a"), seed=0))
    second = tiny_app_args(write_tiny_model_dir(tmp_path_factory.mktemp("model_b"), seed=1))["models"][0]
    args["models"][0]["id"] = "model-a"
    args["models"].append(dict(second, id="model-b"))
    serve.run(build_app(args), name="two", route_prefix="/two", blocking=False)
    url = serve_instance.url("/two")
    wait_ready(url)
    yield url
    delete_app("two")


def answer(url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == model
    return resp.json()["choices"][0]["message"]["content"]


def test_each_model_id_reaches_its_own_worker(two_models):
    ids = [m["id"] for m in httpx.get(two_models + "/v1/models", timeout=30).json()["data"]]
    assert ids == ["model-a", "model-b"]
    a, b = answer(two_models, "model-a"), answer(two_models, "model-b")
    assert a != b  # different weights behind the two ids
    assert answer(two_models, "model-a") == a and answer(two_models, "model-b") == b
    missing = httpx.post(two_models + "/v1/chat/completions",
                         json={"model": "model-c", "messages": [{"role": "user", "content": "x"}]}, timeout=30)
    assert missing.status_code == 404
