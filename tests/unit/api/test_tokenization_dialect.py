"""POST /tokenize and /detokenize at the ingress (no Serve, no worker): validation, vLLM's
defaults, a chat packed exactly as /v1/chat/completions packs it; and `priority` on the
chat and completions requests."""

from __future__ import annotations

import pytest

from serve_app.dialects import completions
from serve_app.dialects.chat import translate as chat_translate
from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.completions import CompletionRequest
from serve_app.dialects.tokenization import (
    DetokenizeBody,
    TokenizeBody,
    to_detokenize_request,
    to_tokenize_request,
)
from serve_app.http.errors import APIError
from serve_app.http.request_body import parse_request
from workers.contract.model_config import ModelConfig

USER = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather", "strict": True,
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALLED = [*USER, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def error(model_cls, body: dict) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(model_cls, body)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_chat_is_packed_as_a_chat_completion_packs_it(parser):
    model = ModelConfig(id="m", tool_call_parser=parser)
    fields = {"model": "m", "messages": CALLED, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}}
    tokenize = to_tokenize_request(parse_request(TokenizeBody, fields), model)
    generate = chat_translate.to_generate_request(parse_request(ChatCompletionRequest, fields), "id", model)
    assert tokenize.messages == generate.messages
    assert tokenize.tools == generate.tools
    assert tokenize.tool_prompt == generate.tool_prompt
    assert tokenize.chat_template_kwargs == generate.chat_template_kwargs


def test_vllm_defaults_for_prompt_and_messages():
    model = ModelConfig(id="m")
    prompt = to_tokenize_request(parse_request(TokenizeBody, {"model": "m", "prompt": "Hi"}), model)
    assert (prompt.prompt, prompt.add_special_tokens, prompt.return_token_strs) == ("Hi", True, False)
    chat = to_tokenize_request(parse_request(TokenizeBody, {"model": "m", "messages": USER}), model)
    assert (chat.add_special_tokens, chat.add_generation_prompt, chat.continue_final_message) == (False, True, False)
    assert chat.tools is None
    asked = to_tokenize_request(parse_request(TokenizeBody, {
        "model": "m", "messages": USER, "add_generation_prompt": False, "continue_final_message": True,
        "add_special_tokens": True, "return_token_strs": True}), model)
    assert (asked.add_special_tokens, asked.add_generation_prompt, asked.continue_final_message,
            asked.return_token_strs) == (True, False, True, True)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": "Hi", "messages": USER}, "messages"),
    ({"model": "m", "messages": USER, "continue_final_message": True}, "continue_final_message"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "prompt": 3}, "prompt"),
    ({"prompt": "Hi"}, "model"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
])
def test_tokenize_validation_names_the_field(body, param):
    assert error(TokenizeBody, body).param == param


def test_image_parts_are_refused_naming_the_part():
    messages = [{"role": "user", "content": [{"type": "text", "text": "what"},
                                             {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]
    req = parse_request(TokenizeBody, {"model": "m", "messages": messages})
    with pytest.raises(APIError) as info:
        to_tokenize_request(req, ModelConfig(id="m"))
    assert (info.value.status, info.value.param) == (400, "messages.0.content.1.image_url")


@pytest.mark.parametrize(("tokens", "param"), [([1, -2], "tokens.1"), ("1 2", "tokens"), ([1.5], "tokens.0")])
def test_detokenize_validation_names_the_field(tokens, param):
    assert error(DetokenizeBody, {"model": "m", "tokens": tokens}).param == param


def test_detokenize_request():
    assert to_detokenize_request(parse_request(DetokenizeBody, {"model": "m", "tokens": [5, 0]})).tokens == [5, 0]


# --------------------------------------------------------------------------- priority


def test_priority_reaches_the_sampling_params_on_chat_and_completions():
    chat = parse_request(ChatCompletionRequest, {"model": "m", "messages": USER, "priority": -3})
    assert chat_translate.to_generate_request(chat, "id").params.priority == -3
    text = parse_request(CompletionRequest, {"model": "m", "prompt": "Once", "priority": 7})
    assert completions.to_generate_request(text, "id").params.priority == 7
    default = parse_request(ChatCompletionRequest, {"model": "m", "messages": USER})
    assert chat_translate.to_generate_request(default, "id").params.priority == 0


@pytest.mark.parametrize("priority", ["high", 1.5, 2**63, None])
def test_priority_must_be_an_integer(priority):
    assert error(ChatCompletionRequest, {"model": "m", "messages": USER, "priority": priority}).param == "priority"
    assert error(CompletionRequest, {"model": "m", "prompt": "Once", "priority": priority}).param == "priority"
