"""The /v1 response side of tools and reasoning (the accumulator and streamer of
serve_app/dialects/chat/output.py), fed worker chunks directly."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion as SDKCompletion
from openai.types.chat import ChatCompletionChunk as SDKChunk

from serve_app.dialects.chat.output import ChunkStreamer, CompletionAccumulator
from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.http.sse import json_text, sse_json
from serve_app.output.choice_parser import OutputParsing
from tests.support.sse_events import sse_lines, sse_payloads
from workers.contract.chunks import GenerationChunk
from workers.contract.model_config import ModelConfig

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
THINKING_CALL = ('<think>I could write <tool_call>{"name": "add", "arguments": {}}</tool_call> here.</think>'
                 'Calling it.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [ADD], **fields})


def chunks_of(text: str, size: int, reason: str = "stop", reasoning_open: bool = False) -> list[GenerationChunk]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    chunks = [GenerationChunk(text=p, token_ids=[7], prompt_tokens=5, completion_tokens=i + 1,
                              reasoning_open=reasoning_open) for i, p in enumerate(pieces)]
    chunks[-1].finish_reason = reason
    return chunks


def accumulate(req, model, chunks):
    acc = CompletionAccumulator("r", "m", req.n, OutputParsing.of(req, model))
    for chunk in chunks:
        acc.add(chunk)
    return json.loads(acc.result().dump_json())


def stream(req, model, chunks) -> list[dict]:
    return sse_payloads(ChunkStreamer("r", req, False, OutputParsing.of(req, model)), chunks)


def test_a_call_written_while_thinking_is_reasoning_not_a_call():
    model = ModelConfig(id="m", reasoning_parser="deepseek_r1")
    body = accumulate(request(), model, chunks_of(THINKING_CALL, 5))
    SDKCompletion.model_validate(body)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == 'I could write <tool_call>{"name": "add", "arguments": {}}</tool_call> here.'
    assert message["content"] == "Calling it."
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert 0 < body["usage"]["completion_tokens_details"]["reasoning_tokens"] < body["usage"]["completion_tokens"]


def test_streamed_deltas_match_the_whole_answer_and_parse_with_the_sdk():
    model = ModelConfig(id="m", reasoning_parser="deepseek_r1")
    req = request(stream=True, stream_options={"include_usage": True})
    whole = accumulate(request(), model, chunks_of(THINKING_CALL, 5))
    events = stream(req, model, chunks_of(THINKING_CALL, 5))
    for event in events:
        SDKChunk.model_validate(event)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == whole["choices"][0]["message"]["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "Calling it."
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    head, body = calls
    assert head["index"] == body["index"] == 0
    assert head["id"].startswith("call_") and head["type"] == "function" and head["function"]["name"] == "add"
    assert head["function"]["arguments"] + body["function"]["arguments"] == '{"a": 1}'
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
    assert events[-1]["usage"]["completion_tokens_details"] == whole["usage"]["completion_tokens_details"]


def test_only_calls_gives_null_content_and_several_calls_get_their_own_indexes():
    text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "add", "arguments": {}}</tool_call>\n'
    body = accumulate(request(), ModelConfig(id="m"), chunks_of(text, 4))
    message = body["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 2
    assert "reasoning_content" not in message and "completion_tokens_details" not in body["usage"]
    events = stream(request(stream=True), ModelConfig(id="m"), chunks_of(text, 4))
    heads = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls") or [] if "id" in c]
    assert [h["index"] for h in heads] == [0, 1]
    assert len({h["id"] for h in heads}) == 2


def test_a_call_cut_by_length_is_not_content_and_the_reason_stays_length():
    text = 'Adding.<tool_call>{"name": "add", "argu'
    body = accumulate(request(), ModelConfig(id="m"), chunks_of(text, 3, reason="length"))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Adding."
    assert "tool_calls" not in choice["message"]


def test_without_tools_or_reasoning_parser_the_text_is_untouched():
    text = "<think>x</think><tool_call>{}</tool_call>"
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    body = accumulate(req, ModelConfig(id="m"), chunks_of(text, 4))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_a_prompt_opened_reasoning_without_end_tag_is_all_reasoning():
    model = ModelConfig(id="m", reasoning_parser="deepseek_r1")
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    body = accumulate(req, model, chunks_of("still thinking about it", 4, reason="length", reasoning_open=True))
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "still thinking about it" and message["content"] == ""
    usage = body["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"] == 6


def test_an_event_stays_one_line_for_clients_that_split_like_str_splitlines():
    """Found by the soak: the model wrote U+2028, httpx's aiter_lines cut the event in two."""
    text = "a\u2028b\u2029c\x85d\nline"
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "stream": True})
    streamer = ChunkStreamer("r", req, False, OutputParsing.of(req, ModelConfig(id="m")))
    lines = "".join(sse_lines(streamer, chunks_of(text, 3))).splitlines()
    payloads = [json.loads(line[6:]) for line in lines if line and line != "data: [DONE]"]
    assert "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads) == text


@pytest.mark.parametrize("value", ["plain ascii", "é \u2028 \x85 \"q\"\n", 42, {"a": ["ü", 1, None]}])
def test_sse_text_is_what_json_dumps_writes(value):
    """The kept encoder writes json.dumps(ensure_ascii=False)'s text, and only events with
    non-ASCII text are scanned for line breakers (which are all non-ASCII)."""
    text = json.dumps(value, ensure_ascii=False)
    assert json_text(value) == text
    event = sse_json(text)
    assert event == "data: " + text.replace("\u2028", "\\u2028").replace("\x85", "\\u0085") + "\n\n"
    assert len(event[:-2].splitlines()) == 1  # one line before the blank that ends the event
