"""LoRA adapters through Ray Serve: one app on the tiny model with a configured adapter, an
adapter directory for run-time loads, two adapter slots per replica and an API key. The
routes, the model list, a chat request through each adapter (equal to peft's merged
model), Serve's multiplexing evicting and reloading, and the 401 / 400 / 404 answers."""

from __future__ import annotations

import httpx
import pytest

from tests.support.engines import template_ids
from tests.support.lora_adapters import merged_greedy, merged_model, write_peft_adapter
from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    delete_app,
    tiny_app_args,
    wait_ready,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KEY = "sk-lora-7Hq2Wm"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = "Paris is the capital of"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def lora_app(serve_instance, tiny_model_dir, tiny_model, tmp_path_factory):
    from ray import serve

    from serve_app.app import build_app

    root = tmp_path_factory.mktemp("lora_serve")
    runtime = root / "adapters"
    dirs = {"fixed": write_peft_adapter(tiny_model, root / "fixed", seed=21),
            "b": write_peft_adapter(tiny_model, runtime / "b", seed=22),
            "c": write_peft_adapter(tiny_model, runtime / "c", seed=23, rank=2),
            "wide": write_peft_adapter(tiny_model, runtime / "wide", seed=24, rank=16)}
    (root / "keys").write_text(KEY + "\n")
    args = tiny_app_args(tiny_model_dir)
    args["models"][0]["lora"] = {"adapters": {"fixed": str(dirs["fixed"])}, "adapter_dir": str(runtime),
                                 "max_loras": 2, "max_lora_rank": 8}
    args["server"] = {"api_keys_file": str(root / "keys")}
    serve.run(build_app(args), name="lora", route_prefix="/lora", blocking=False)
    url = serve_instance.url("/lora")
    wait_ready(url, headers=AUTH)
    yield url, dirs
    delete_app("lora")


def _chat(url: str, model: str, headers=AUTH) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": TEXT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "logprobs": True}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def _post(url: str, route: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, headers=headers, timeout=60)


def test_lora_routes_through_serve(lora_app, tiny_model, tiny_tokenizer):
    url, dirs = lora_app
    prompt = template_ids(tiny_tokenizer, TEXT)

    def expected(name: str | None) -> list[str]:
        """Each token as the server's logprobs write it (decoded alone: the tiny model's
        random tokens are often partial UTF-8, so the reply's text is a weaker check)."""
        model = tiny_model if name is None else merged_model(tiny_model, dirs[name])
        return [tiny_tokenizer.decode([t]) for t in merged_greedy(model, prompt, MAX_TOKENS)]

    def content(model: str) -> list[str]:
        response = _chat(url, model)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        return [t["token"] for t in response.json()["choices"][0]["logprobs"]["content"]]

    # Every route but /health wants the key.
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "b"}, headers={}).status_code == 401
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "b"}, headers={}).status_code == 401
    assert _chat(url, "fixed", headers={}).status_code == 401

    assert content("fixed") == expected("fixed") != expected(None)
    assert content(TINY_MODEL_ID) == expected(None)

    loaded = _post(url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "b"})
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(dirs["c"])}).status_code == 200
    cards = {card["id"]: card for card in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]}
    assert set(cards) == {TINY_MODEL_ID, "fixed", "b", "c"}
    assert cards["b"]["parent"] == TINY_MODEL_ID and cards["b"]["root"] == str(dirs["b"].resolve())
    assert "parent" not in cards[TINY_MODEL_ID]
    for name in (TINY_MODEL_ID, "fixed", "b"):  # GET /v1/models/{model}: the same card
        assert httpx.get(f"{url}/v1/models/{name}", headers=AUTH).json() == cards[name]

    # Three adapters on a replica with two slots: Serve's multiplexing drops the least
    # recently used one and loads it again when it is asked for.
    for name in ["b", "c", "fixed", "b", "c"]:
        assert content(name) == expected(name), name

    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    gone = _chat(url, "b")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 404
    # A name with "/" is taken whole by GET /v1/models/{model}.
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "team/b", "lora_path": "b"}).status_code == 200
    card = httpx.get(f"{url}/v1/models/team/b", headers=AUTH).json()
    assert (card["id"], card["parent"], card["root"]) == ("team/b", TINY_MODEL_ID, str(dirs["b"].resolve()))


@pytest.mark.parametrize("body, status, param, message", [
    ({"lora_name": "w", "lora_path": "wide"}, 400, "lora_path", "rank 16 is above this model's max_lora_rank 8"),
    ({"lora_name": "x", "lora_path": "/etc"}, 400, "lora_path", "outside the adapter directory"),
    ({"lora_name": "fixed", "lora_path": "c"}, 400, "lora_name", "already a served model"),
    ({"lora_name": "x"}, 400, "lora_path", "Field required"),
])
def test_load_refusals(lora_app, body, status, param, message):
    url, _ = lora_app
    response = _post(url, "/v1/load_lora_adapter", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_unknown_model_is_404(lora_app):
    url, _ = lora_app
    response = _chat(url, "no-such-adapter")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
