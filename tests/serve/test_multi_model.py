"""Three models behind one ingress, routed by the request's `model`: two generating ones, and
an encoder (`runner: auto` finds it from its config) that serves /v1/embeddings to the
OpenAI SDK, /tokenize and /health, and refuses generation on every dialect."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from ray import serve
from transformers import AutoModel, AutoTokenizer

from serve_app.app import build_app
from tests.support.serve_fixtures import delete_app, tiny_app_args, wait_ready
from tests.support.tiny_models import write_tiny_encoder_dir, write_tiny_model_dir


@pytest.fixture(scope="module")
def two_models(serve_instance, tmp_path_factory):
    args = tiny_app_args(write_tiny_model_dir(tmp_path_factory.mktemp("model_a"), seed=0))
    second = tiny_app_args(write_tiny_model_dir(tmp_path_factory.mktemp("model_b"), seed=1))["models"][0]
    args["models"][0]["id"] = "model-a"
    args["models"].append(dict(second, id="model-b"))
    encoder = write_tiny_encoder_dir(tmp_path_factory.mktemp("encoder"))
    args["models"].append(dict(second, id="encoder", source=str(encoder)))
    serve.run(build_app(args), name="two", route_prefix="/two", blocking=False)
    url = serve_instance.url("/two")
    wait_ready(url)
    yield url, encoder
    delete_app("two")


def answer(url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == model
    return resp.json()["choices"][0]["message"]["content"]


def test_each_model_id_reaches_its_own_worker(two_models):
    two_models, _ = two_models
    ids = [m["id"] for m in httpx.get(two_models + "/v1/models", timeout=30).json()["data"]]
    assert ids == ["model-a", "model-b", "encoder"]
    a, b = answer(two_models, "model-a"), answer(two_models, "model-b")
    assert a != b  # different weights behind the two ids
    assert answer(two_models, "model-a") == a and answer(two_models, "model-b") == b
    missing = httpx.post(two_models + "/v1/chat/completions",
                         json={"model": "model-c", "messages": [{"role": "user", "content": "x"}]}, timeout=30)
    assert missing.status_code == 404


def test_an_encoder_embeds_and_refuses_generation(two_models):
    url, encoder_dir = two_models
    texts = ["The quick brown fox.", "Hello! How can I assist you today?"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.embeddings.create(model="encoder", input=texts)  # the SDK asks for base64
    model, tokenizer = AutoModel.from_pretrained(encoder_dir).eval(), AutoTokenizer.from_pretrained(encoder_dir)
    for data, text in zip(out.data, texts):
        with torch.no_grad():
            cls = model(input_ids=torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0, 0]
        assert torch.allclose(torch.tensor(data.embedding), F.normalize(cls, dim=-1), atol=1e-4)
    assert out.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in texts)
    counted = httpx.post(url + "/tokenize", json={"model": "encoder", "prompt": texts[0]}, timeout=30).json()
    assert counted["tokens"] == tokenizer(texts[0])["input_ids"] and counted["max_model_len"] == 66
    chat = httpx.post(url + "/v1/chat/completions", timeout=30,
                      json={"model": "encoder", "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"
    assert "embedding model" in chat.json()["error"]["message"]
    messages = httpx.post(url + "/v1/messages", timeout=30, json={"model": "encoder", "max_tokens": 8,
                                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert messages.status_code == 400 and messages.json()["type"] == "error"
    health = httpx.get(url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["models"]["encoder"]["ready"]
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert 'chatserve_requests_total{model="encoder",route="/v1/embeddings",status="200"} 1.0' in metrics
    assert 'chatserve_prompt_tokens_total{model="encoder"}' in metrics
