"""Every rule between fields of /v1/chat/completions and /v1/completions fails the request
at parse time (`parse_request`, as the routes and the handle API call it): a 400 with the
field's param, the rule's message and, where set, its code. No Serve, no worker."""

from __future__ import annotations

import pytest

from serve_app.dialects import completions
from serve_app.dialects.chat import translate as chat_translate
from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.completions import CompletionRequest
from serve_app.dialects.lm_v2 import LmV2ChatRequest
from serve_app.http.errors import APIError
from serve_app.http.request_body import parse_request
from serve_app.schema.common import token_id

USER = [{"role": "user", "content": "Hi"}]
SHIP = {"type": "function", "function": {"name": "ship", "parameters": {"type": "object", "properties": {}}}}
BEAM = {"use_beam_search": True, "n": 2, "temperature": 0}


def chat_error(**fields) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, {"model": "m", "messages": USER, **fields})
    assert info.value.status == 400
    return info.value


def completion_error(**fields) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, {"model": "m", "prompt": "Once", **fields})
    assert info.value.status == 400
    return info.value


# ------------------------------------------------------------------------------ chat

CHAT_RULES = [
    ({"tools": [SHIP, SHIP]}, "tools", "function names in tools must be unique"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [SHIP], "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice",
     "tool_choice names 'fly', which is not among the tools ['ship']"),
    ({"tools": [SHIP], "tool_choice": "required", **BEAM}, "tool_choice",
     "forced or strict tool calls are not available with beam search"),
    ({"tools": [SHIP], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "response_format cannot be combined with forced or strict tool calls"),
    ({"use_beam_search": True}, "n", "beam search needs n > 1"),
    ({**BEAM, "n": 3, "best_of": 2}, "best_of", "best_of (2) must be at least n (3)"),
    ({**BEAM, "temperature": 0.5}, "temperature", "beam search needs temperature 0"),
    ({**BEAM, "top_p": 0.9}, "top_p", "beam search needs top_p 1"),
    ({**BEAM, "top_k": 5}, "top_k", "beam search needs top_k -1"),
    ({**BEAM, "logprobs": True}, "logprobs", "logprobs are not available with beam search"),
    ({**BEAM, "response_format": {"type": "json_object"}}, "response_format",
     "structured output (response_format) is not available with beam search"),
    ({"best_of": 2}, "best_of", "best_of is only supported with use_beam_search"),
    ({"length_penalty": 0.5}, "length_penalty", "length_penalty needs use_beam_search: true"),
    ({"n": 2, "temperature": 0}, "n",
     "n > 1 needs sampling: greedy decoding (temperature 0 or top_k 1) would give n identical choices"),
    ({"n": 2, "top_k": 1}, "n",
     "n > 1 needs sampling: greedy decoding (temperature 0 or top_k 1) would give n identical choices"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs to be true"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens", "min_tokens (9) is larger than max_tokens (3)"),
    ({"min_tokens": 9, "max_tokens": 50, "max_completion_tokens": 4}, "min_tokens",
     "min_tokens (9) is larger than max_tokens (4)"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias keys must be token ids, got 'abc'"),
    ({"logit_bias": {"-3": 1}}, "logit_bias", "logit_bias keys must be token ids, got '-3'"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias values must be in [-100, 100], got 101.0 for token 5"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias",
     "logit_bias values must be in [-100, 100], got -100.5 for token 5"),
]


@pytest.mark.parametrize(("fields", "param", "message"), CHAT_RULES)
def test_chat_rules_fail_at_parse_time(fields, param, message):
    error = chat_error(**fields)
    assert (error.param, error.message, error.code) == (param, message, None)


def test_chat_stream_options_need_stream():
    error = chat_error(stream_options={"include_usage": True})
    assert error.param is None
    assert error.message == "Value error, stream_options is only allowed when stream is true"


def test_chat_rules_hold_with_beam_search_too():
    # Before, beam search skipped them: a bad logit_bias key then failed in translation (500).
    assert chat_error(**BEAM, logit_bias={"abc": 1}).param == "logit_bias"
    assert chat_error(**BEAM, min_tokens=5, max_tokens=2).param == "min_tokens"


def test_beam_search_takes_temperature_0_with_n_above_1():
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": USER, **BEAM, "best_of": 4})
    assert chat_translate.to_generate_request(req, "r").params.use_beam_search


# ------------------------------------------------------------------------ completions

COMPLETION_RULES = [
    ({"use_beam_search": True}, "n", "beam search needs n > 1"),
    ({**BEAM, "temperature": 0.5}, "temperature", "beam search needs temperature 0"),
    ({**BEAM, "logprobs": 0}, "logprobs", "logprobs are not available with beam search"),
    ({"length_penalty": 0.5}, "length_penalty", "length_penalty needs use_beam_search: true"),
    ({"n": 3, "best_of": 2}, "best_of", "best_of (2) must be at least n (3)"),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of",
     "best_of > n cannot stream: the best choices are known only at the end"),
    ({"n": 2, "temperature": 0}, "n",
     "n > 1 needs sampling: greedy decoding (temperature 0 or top_k 1) gives identical choices"),
    ({"best_of": 3, "top_k": 1}, "best_of",
     "best_of > 1 needs sampling: greedy decoding (temperature 0 or top_k 1) gives identical choices"),
    ({"logprobs": 1, "echo": True}, "logprobs",
     "logprobs with echo (prompt logprobs) are not supported; drop one of them"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens", "min_tokens (20) is larger than max_tokens (5)"),
    ({"min_tokens": 17}, "min_tokens", "min_tokens (17) is larger than max_tokens (16)"),  # the default cap
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias keys must be token ids, got 'abc'"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "logit_bias keys must be token ids, got '-1'"),
    ({"logit_bias": {"5": 200}}, "logit_bias", "logit_bias values must be in [-100, 100], got 200.0 for token 5"),
]


@pytest.mark.parametrize(("fields", "param", "message"), COMPLETION_RULES)
def test_completion_rules_fail_at_parse_time(fields, param, message):
    error = completion_error(**fields)
    assert (error.param, error.message, error.code) == (param, message, None)


def test_suffix_is_refused():
    error = completion_error(suffix="tail")
    assert error.status == 400 and error.param == "suffix"
    assert error.code == "unsupported_parameter"
    assert error.message == "`suffix` is not supported on /v1/completions"


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"n": 2, "temperature": 0}, "n"), ({"best_of": 3, "top_k": 1}, "best_of"), ({"n": 3, "best_of": 2}, "best_of"),
     ({"n": 1, "best_of": 2, "stream": True}, "best_of"), ({"logprobs": 1, "echo": True}, "logprobs"),
     ({"use_beam_search": True}, "n"), ({"use_beam_search": True, "n": 2, "temperature": 0.5}, "temperature"),
     ({"use_beam_search": True, "n": 2, "logprobs": 0}, "logprobs"), ({"length_penalty": 0.5}, "length_penalty")],
)
def test_cross_field_rules(fields, param):
    error = completion_error(**fields)
    assert error.status == 400 and error.param == param


def test_completion_stream_options_need_stream():
    error = completion_error(stream_options={"include_usage": True})
    assert error.param is None
    assert error.message == "Value error, stream_options is only allowed when stream is true"


def test_lm_v2_stream_options_need_stream():
    with pytest.raises(APIError) as info:
        parse_request(LmV2ChatRequest, {"model": "m", "messages": USER, "stream_options": {"include_usage": True}})
    assert (info.value.status, info.value.param) == (400, None)
    assert info.value.message == "Value error, stream_options is only allowed when stream is true"


# ----------------------------------------------------------------- shared logit_bias rule


def test_logit_bias_keys_are_json_text_on_both_routes():
    chat = parse_request(ChatCompletionRequest, {"model": "m", "messages": USER, "logit_bias": {"11": -100, "12": 5}})
    text = parse_request(CompletionRequest, {"model": "m", "prompt": "Once", "logit_bias": {"11": -100, "12": 5}})
    assert chat_translate.to_generate_request(chat, "r").params.logit_bias == {11: -100.0, 12: 5.0}
    assert completions.to_generate_request(text, "r").params.logit_bias == {11: -100.0, 12: 5.0}


@pytest.mark.parametrize(("key", "expected"), [
    ("0", 0), ("123", 123), ("-0", 0), ("-1", None), ("abc", None), ("", None), ("1.5", None), (" 5", None),
    ("--5", None), ("\u00b2", None), ("1" * 5000, None),
])
def test_token_id_reads_what_int_reads_and_refuses_the_rest(key, expected):
    assert token_id(key) == expected


def test_a_superscript_key_is_a_400_not_a_500():
    assert chat_error(logit_bias={"\u00b2": 1}).message == "logit_bias keys must be token ids, got '\u00b2'"


def test_one_rule_message_for_both_routes():
    for fields in ({"logit_bias": {"x": 1}}, {"logit_bias": {"7": 150}}, {"min_tokens": 9, "max_tokens": 3}):
        chat, text = chat_error(**fields), completion_error(**fields)
        assert (chat.param, chat.message) == (text.param, text.message)
