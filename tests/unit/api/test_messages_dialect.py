"""/v1/messages without a server: request rules (400 naming the field), the translation to a
chat request, content blocks and stream events from worker chunks (checked against the
`anthropic` SDK's types and its stream assembly), stop reasons and Anthropic's error shape."""

from __future__ import annotations

import asyncio
import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message as SDKMessage
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from serve_app.dialects.chat.translate import (
    to_generate_request as chat_generate_request,
)
from serve_app.dialects.messages.output import (
    MessageAccumulator,
    MessageBuilder,
    MessageStreamer,
)
from serve_app.dialects.messages.request import CountTokensRequest, MessagesRequest
from serve_app.dialects.messages.response import error_body
from serve_app.dialects.messages.route import count_tokens_fields
from serve_app.dialects.messages.translate import messages_params, to_chat_request
from serve_app.dialects.table import DIALECTS
from serve_app.dialects.tokenization import TokenizeBody
from serve_app.http.errors import APIError
from serve_app.http.request_body import parse_request
from serve_app.output.choice_parser import OutputParsing
from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.model_config import ModelConfig

ADD = {"name": "add", "description": "Add.", "input_schema": {"type": "object"}}
EVENTS = TypeAdapter(RawMessageStreamEvent)
THINKING_CALLS = ('<think>Add them.</think>\nSure.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
                  '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
USER = {"role": "user", "content": "hi"}


def request(**fields) -> MessagesRequest:
    return parse_request(MessagesRequest, {"model": "m", "max_tokens": 64, "messages": [USER], **fields})


# ------------------------------------------------------------------------ request rules

@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages.0.content.0.source.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "add", "input": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [USER, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.1.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"tools": [ADD, {"type": "bash_20250124", "name": "bash"}]}, "tools.1.type"),
    ({"tools": [ADD, ADD]}, "tools"),
    ({"tools": [{**ADD, "input_schema": None}]}, "tools.0.input_schema"),
    ({"tool_choice": {"type": "auto"}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "tool", "name": "sub"}}, "tool_choice.name"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking.budget_tokens"),  # >= max_tokens
    ({"mcp_servers": [{"type": "url", "url": "https://x"}]}, "mcp_servers"),
])
def test_bad_requests_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as info:
        request(**body)
    assert (info.value.status, info.value.param) == (400, param), info.value.message
    assert param in info.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{**ADD, "name": "add it!"}]}, "tools.0.name"),
    ({"tools": [{**ADD, "input_schema": {"type": "objekt"}}]}, "tools.0.input_schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "objekt"}}}}, "output_config.format"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
])
def test_rules_of_the_chat_path_name_messages_fields(body, param):
    with pytest.raises(APIError) as info, messages_params():
        chat_generate_request(to_chat_request(request(**body)), "msg_1")
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_turns_become_chat_messages():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    chat = to_chat_request(request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        tools=[ADD], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "disabled"}, stop_sequences=["END"], top_k=5, metadata={"user_id": "u"},
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Add "}, {"type": "text", "text": "1."}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Calling."},
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}},
                {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {"a": 2}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "1"},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/plot.png"}}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no", "is_error": True},
                {"type": "text", "text": "Look:"}, image]},
            {"role": "assistant", "content": "The sum is"}]))
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": "Add 1."},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "1"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/plot.png"}},
                                     {"type": "text", "text": "Look:"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "The sum is"},
    ]
    assert (chat.add_generation_prompt, chat.continue_final_message) == (False, True)
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert (chat.stop, chat.top_k, chat.user, chat.max_tokens) == (["END"], 5, "u", 64)
    assert chat.tools[0].function.parameters == {"type": "object"}


def test_a_tool_results_images_open_the_user_message_after_the_tool_messages():
    """A chat `tool` message carries text only: a result that is all image leaves it empty."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    chat = to_chat_request(request(tools=[ADD], messages=[
        USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}]}]))
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": ""},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
    ]


def test_an_enabled_thinkings_budget_is_the_chat_requests_thinking_token_budget():
    chat = to_chat_request(request(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 2048}))
    assert (chat.thinking_token_budget, chat.chat_template_kwargs) == (2048, {"enable_thinking": True})
    assert to_chat_request(request(thinking={"type": "adaptive"})).thinking_token_budget is None


def test_tool_choice_forms():
    named = to_chat_request(request(tools=[ADD], tool_choice={"type": "tool", "name": "add"}))
    assert named.tool_choice.function.name == "add" and named.parallel_tool_calls is None
    assert to_chat_request(request(tools=[ADD], tool_choice={"type": "none"})).tools_in_play == []
    assert to_chat_request(request(tools=[ADD])).effective_tool_choice == "auto"
    plain = to_chat_request(request())
    assert (plain.add_generation_prompt, plain.continue_final_message, plain.chat_template_kwargs) == (True, False, None)


def test_count_tokens_templates_the_prompt_as_generation_does():
    req = parse_request(CountTokensRequest, {"model": "m", "messages": [USER], "tools": [ADD],
                                             "thinking": {"type": "enabled", "budget_tokens": 2048}})
    body = parse_request(TokenizeBody, count_tokens_fields(req))
    assert body.messages[0].content == "hi" and body.tools[0].function.name == "add"
    assert body.chat_template_kwargs == {"enable_thinking": True} and body.add_generation_prompt


# ------------------------------------------------------------------------------ output

def chunks_of(text: str, size: int, reason: str = "stop", stop_reason=None) -> list[GenerationChunk]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    chunks = [GenerationChunk(text=p, token_ids=[7], prompt_tokens=5, completion_tokens=i + 1, cached_tokens=4)
              for i, p in enumerate(pieces)]
    chunks[-1].finish_reason, chunks[-1].stop_reason = reason, stop_reason
    return chunks


def builder(req: MessagesRequest, model: ModelConfig | None = None) -> MessageBuilder:
    return MessageBuilder("msg_1", req, OutputParsing.of(to_chat_request(req), model))


def whole(req, chunks, model=None) -> dict:
    acc = MessageAccumulator(builder(req, model))
    for chunk in chunks:
        acc.add(chunk)
    body = json.loads(acc.result().dump_json())
    SDKMessage.model_validate(body)
    return body


def streamed(req, chunks, model=None) -> list[tuple[str, dict]]:
    async def rest():
        for chunk in chunks[1:]:
            yield chunk

    async def collect():
        return [e async for e in MessageStreamer(builder(req, model)).events(chunks[0], rest())]

    events = []
    for text in asyncio.run(collect()):
        name, data = text.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: ") and text.endswith("\n\n")
        events.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return events


def assembled(events: list[tuple[str, dict]]) -> dict:
    """The message the SDK's stream helper builds from the events."""
    snapshot, buffers = None, {}
    for _, event in events:
        snapshot = accumulate_event(event=EVENTS.validate_python(event), current_snapshot=snapshot, json_bufs=buffers)
    return snapshot.model_dump(exclude_none=True)


def without_ids(blocks: list[dict]) -> list[dict]:
    return [{k: v for k, v in block.items() if k != "id"} for block in blocks]


def test_thinking_text_and_calls_are_blocks_in_order():
    body = whole(request(tools=[ADD]), chunks_of(THINKING_CALLS, 4), ModelConfig(id="m", reasoning_parser="deepseek_r1"))
    thinking, text, first, second = body["content"]
    assert thinking == {"type": "thinking", "thinking": "Add them.", "signature": ""}
    assert text == {"type": "text", "text": "\nSure."}
    assert [(c["type"], c["name"], c["input"]) for c in (first, second)] == [
        ("tool_use", "add", {"a": 1}), ("tool_use", "add", {"a": 2})]
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    assert body["usage"] == {"input_tokens": 5, "output_tokens": len(chunks_of(THINKING_CALLS, 4)),
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4}


def test_gpt_oss_harmony_gives_a_thinking_block_a_text_preamble_and_a_tool_use():
    harmony = ("<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>commentary<|message|>"
               "Sure.<|end|><|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
               '{"a": 1}<|call|>')
    model = ModelConfig(id="m", reasoning_parser="openai_gptoss", tool_call_parser="openai")
    body = whole(request(tools=[ADD]), chunks_of(harmony, 4), model)
    thinking, text, call = body["content"]
    assert thinking == {"type": "thinking", "thinking": "Add them.", "signature": ""}
    assert text == {"type": "text", "text": "Sure."}
    assert (call["type"], call["name"], call["input"]) == ("tool_use", "add", {"a": 1})
    assert body["stop_reason"] == "tool_use"


def test_stream_events_are_typed_ordered_and_assemble_to_the_whole_message():
    model = ModelConfig(id="m", reasoning_parser="deepseek_r1")
    req = request(tools=[ADD], stream=True)
    events = streamed(req, chunks_of(THINKING_CALLS, 3), model)
    assert all(name == e["type"] for name, e in events)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"] and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == 5
    starts = [e["index"] for name, e in events if name == "content_block_start"]
    stops = [e["index"] for name, e in events if name == "content_block_stop"]
    assert starts == stops == [0, 1, 2, 3]
    final = assembled(events)
    expected = whole(req, chunks_of(THINKING_CALLS, 3), model)
    assert without_ids(final["content"]) == without_ids(expected["content"]) and final["stop_reason"] == "tool_use"
    assert final["usage"]["output_tokens"] == expected["usage"]["output_tokens"]
    pieces = [e["delta"]["partial_json"] for name, e in events
              if name == "content_block_delta" and e["index"] == 2]
    assert len(pieces) > 1 and "".join(pieces) == '{"a": 1}'


def test_a_call_cut_by_the_cap_is_not_in_the_message_and_its_streamed_block_closes():
    cut = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "add", "arguments": {"a'
    req, model = request(tools=[ADD], tool_choice={"type": "any"}, max_tokens=40), ModelConfig(id="m")  # hermes
    body = whole(req, chunks_of(cut, 4, reason="length"), model)
    assert [(b["type"], b["input"]) for b in body["content"]] == [("tool_use", {"a": 1})]
    assert body["stop_reason"] == "max_tokens" and "<tool_call>" not in json.dumps(body)
    events = streamed(req, chunks_of(cut, 4, reason="length"), model)
    starts = [e["content_block"]["type"] for name, e in events if name == "content_block_start"]
    assert starts == ["tool_use", "tool_use"]
    assert [e["index"] for name, e in events if name == "content_block_stop"] == [0, 1]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


@pytest.mark.parametrize(("text", "reason", "stop", "expected"), [
    ("Hi there", "stop", None, ("end_turn", None)),
    ("Hi there", "stop", 2, ("end_turn", None)),  # an EOS token id
    ("Hi there", "stop", "END", ("stop_sequence", "END")),
    ("Hi there", "length", None, ("max_tokens", None)),
    ("  \n", "length", None, ("max_tokens", None)),
])
def test_stop_reasons(text, reason, stop, expected):
    body = whole(request(), chunks_of(text, 2, reason=reason, stop_reason=stop))
    assert (body["stop_reason"], body["stop_sequence"]) == expected
    assert body["content"] == [{"type": "text", "text": text}]  # whitespace-only text is kept without calls


def test_worker_error_after_the_start_is_an_error_event_and_the_stream_ends():
    chunks = chunks_of("Hello", 2)
    chunks[-1] = GenerationChunk(error=ErrorInfo(503, "worker gone", type="server_error", code="worker_failed"))
    events = streamed(request(stream=True), chunks)
    name, error = events[-1]
    assert name == "error" and error == {"type": "error", "error": {"type": "overloaded_error",
                                                                    "message": "worker gone"}}
    assert "message_stop" not in [n for n, _ in events]


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (401, "authentication_error"),
                                              (404, "not_found_error"), (413, "request_too_large"),
                                              (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error")])
def test_error_types_follow_the_status(status, kind):
    assert error_body(APIError(status, "m")) == {"type": "error", "error": {"type": kind, "message": "m"}}


def test_the_messages_route_is_a_row_of_the_dialect_table():
    [row] = [d for d in DIALECTS if d.path == "/v1/messages"]
    assert row.request_model is MessagesRequest and row.error_response is not None
    assert all(d.error_response is None for d in DIALECTS if d is not row)
