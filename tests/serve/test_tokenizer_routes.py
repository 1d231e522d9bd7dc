"""POST /tokenize, /detokenize and GET /v1/models/{model} on the tiny app, and `priority`
refused by its fcfs engine (httpx for vLLM's routes, the openai client for OpenAI's)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.serve_fixtures import TINY_MODEL_ID

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! How are you?"}]
PROMPT = "Paris is the capital of France, café 你好."


@pytest.fixture(scope="module")
def client(tiny_app):
    return openai.OpenAI(base_url=tiny_app + "/v1", api_key="unused", max_retries=0)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def assert_error(resp: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param)
    if code is not None:
        assert err["code"] == code
    return err


def test_tokenize_then_detokenize_gives_the_prompt_back(tiny_app):
    tokens = post(tiny_app, "/tokenize", {"model": TINY_MODEL_ID, "prompt": PROMPT, "return_token_strs": True}).json()
    assert set(tokens) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 5
    assert tokens["max_model_len"] == 256
    text = post(tiny_app, "/detokenize", {"model": TINY_MODEL_ID, "tokens": tokens["tokens"]}).json()
    assert text == {"prompt": PROMPT}


def test_messages_count_is_the_chat_requests_prompt_tokens(tiny_app, client):
    counted = post(tiny_app, "/tokenize", {"model": TINY_MODEL_ID, "messages": MESSAGES}).json()
    assert counted["token_strs"] is None
    chat = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=1)
    assert counted["count"] == chat.usage.prompt_tokens


def test_a_prompt_past_the_window_is_counted(tiny_app):
    counted = post(tiny_app, "/tokenize", {"model": TINY_MODEL_ID, "prompt": "the quick brown fox " * 100}).json()
    assert counted["count"] > counted["max_model_len"]


def test_tokenizer_route_errors(tiny_app):
    assert_error(post(tiny_app, "/tokenize", {"model": "nope", "prompt": "x"}), 404, "model", "model_not_found")
    assert_error(post(tiny_app, "/detokenize", {"model": "nope", "tokens": [1]}), 404, "model", "model_not_found")
    assert_error(post(tiny_app, "/tokenize", {"model": TINY_MODEL_ID}), 400, "prompt")
    assert_error(post(tiny_app, "/detokenize", {"model": TINY_MODEL_ID, "tokens": [1, 10**6]}), 400, "tokens",
                 "invalid_token_id")
    assert_error(post(tiny_app, "/detokenize", {"model": TINY_MODEL_ID, "tokens": [-1]}), 400, "tokens.0")


def test_models_retrieve(client):
    card = client.models.retrieve(TINY_MODEL_ID)
    listed = client.models.list().data[0]
    assert card.model_dump() == listed.model_dump()
    assert (card.id, card.object, card.owned_by, card.model_extra["max_model_len"]) == (
        TINY_MODEL_ID, "model", "chatserve", 256)


def test_models_retrieve_unknown_with_a_slash_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("org/unknown-model")
    err = info.value.body
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert "org/unknown-model" in err["message"]  # the whole id reached the route, slash included


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "Once"}),
])
def test_fcfs_engine_refuses_a_priority(tiny_app, path, body):
    request = {"model": TINY_MODEL_ID, "max_tokens": 1, **body}
    err = assert_error(post(tiny_app, path, {**request, "priority": 1}), 400, "priority")
    assert "scheduling_policy" in err["message"]
    assert post(tiny_app, path, {**request, "priority": 0}).status_code == 200
