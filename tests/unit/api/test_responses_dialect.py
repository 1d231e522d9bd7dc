"""/v1/responses without a server: request rules (400 naming the field), the translation to a
chat request, output items and typed events from worker chunks (checked against the OpenAI
SDK's types and its stream assembly), and the bounded response store."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from serve_app.dialects.chat.translate import (
    to_generate_request as chat_generate_request,
)
from serve_app.dialects.responses.output import (
    ResponseAccumulator,
    ResponseBuilder,
    ResponseStreamer,
)
from serve_app.dialects.responses.request import ResponsesRequest
from serve_app.dialects.responses.store import ResponseStore
from serve_app.dialects.responses.translate import output_messages, to_chat_request
from serve_app.http.errors import APIError
from serve_app.http.request_body import parse_request
from serve_app.output.choice_parser import OutputParsing
from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.model_config import ModelConfig

ADD = {"type": "function", "name": "add", "parameters": {"type": "object"}}
EVENTS = TypeAdapter(ResponseStreamEvent)


def request(**fields) -> ResponsesRequest:
    return parse_request(ResponsesRequest, {"model": "m", "input": "hi", **fields})


# ------------------------------------------------------------------------ request rules

@pytest.mark.parametrize(("body", "param"), [
    ({"input": None}, "input"),
    ({"input": [{"type": "function_call", "name": "add", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": ["hi", {"type": "item_reference", "id": "x"}]}, "input.0"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "item_reference", "id": "x"}]}, "input.1.type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input.0.content.0.file_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input.0.output"),
    ({"tools": [ADD, {"type": "web_search"}]}, "tools.1.type"),
    ({"tools": [{**ADD, "name": "add it!"}]}, "tools.0.name"),
    ({"tools": [{**ADD, "parameters": {"type": "objekt"}}]}, "tools.0.parameters"),
    ({"tools": [ADD, ADD]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"tools": [{**ADD, "strict": True}], "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"previous_response_id": "chatcmpl-1"}, "previous_response_id"),
])
def test_bad_requests_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as info:
        to_chat_request(request(**body))
    error = info.value
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param), error.message


def test_items_become_chat_messages_with_tool_calls():
    req = request(instructions="Be brief.", max_output_tokens=7, input=[
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "1+2"}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\": 1}", "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "0"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "3 and 0", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "this?"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AA"}]},
    ], tools=[ADD], tool_choice={"type": "function", "name": "add"})
    chat = to_chat_request(req)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages[:3] == [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
                            {"role": "user", "content": "1+2?"}]
    calls = messages[3]["tool_calls"]
    assert messages[3]["role"] == "assistant" and [c["id"] for c in calls] == ["c1", "c2"]
    assert calls[0]["function"] == {"name": "add", "arguments": "{\"a\": 1}"}
    assert messages[4:6] == [{"role": "tool", "content": "3", "tool_call_id": "c1"},
                             {"role": "tool", "content": "0", "tool_call_id": "c2"}]
    assert messages[6] == {"role": "assistant", "content": "3 and 0"}
    assert messages[7]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    assert chat.max_completion_tokens == 7 and chat.tool_choice.function.name == "add"
    assert chat.tools[0].function.name == "add"
    text = {"format": {"type": "json_schema", "name": "sum", "schema": {"type": "object"}, "strict": True}}
    formatted = to_chat_request(request(text=text, tools=[ADD]))
    assert formatted.response_format.json_schema.schema_ == {"type": "object"}
    # A forced call has no text to format: the format is dropped, the call's grammar kept.
    assert to_chat_request(request(text=text, tools=[ADD], tool_choice="required")).response_format is None


# ----------------------------------------------------------------------------- output

THINKING_CALLS = ('<think>Add them.</think>\nSure.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
                  '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')


def chunks_of(text: str, size: int, reason: str = "stop") -> list[GenerationChunk]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    chunks = [GenerationChunk(text=p, token_ids=[7], prompt_tokens=5, completion_tokens=i + 1)
              for i, p in enumerate(pieces)]
    chunks[-1].finish_reason = reason
    return chunks


def builder(req: ResponsesRequest, model: ModelConfig | None = None) -> ResponseBuilder:
    return ResponseBuilder("resp_1", req, OutputParsing.of(to_chat_request(req), model))


def whole(req, chunks, model=None) -> dict:
    acc = ResponseAccumulator(builder(req, model))
    for chunk in chunks:
        acc.add(chunk)
    return json.loads(acc.result().dump_json())


def streamed(req, chunks, model=None) -> list[tuple[str, dict]]:
    async def rest():
        for chunk in chunks[1:]:
            yield chunk

    async def collect():
        return [e async for e in ResponseStreamer(builder(req, model)).events(chunks[0], rest())]

    events = []
    for text in asyncio.run(collect()):
        name, data = text.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: ") and text.endswith("\n\n")
        events.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return events


def without_ids(response: dict) -> dict:
    """A response with its generated ids and time left out."""
    output = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    return {**{k: v for k, v in response.items() if k not in ("id", "created_at")}, "output": output}


def test_reasoning_text_and_calls_are_items_in_order():
    req = request(tools=[ADD])
    body = whole(req, chunks_of(THINKING_CALLS, 4), ModelConfig(id="m", reasoning_parser="deepseek_r1"))
    SDKResponse.model_validate(body)
    assert body["status"] == "completed" and body["incomplete_details"] is None
    reasoning, message, first, second = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "Add them."}]
    assert message["type"] == "message" and message["content"][0]["text"] == "\nSure."
    assert [(c["type"], c["name"], c["arguments"]) for c in (first, second)] == [
        ("function_call", "add", '{"a": 1}'), ("function_call", "add", '{"a": 2}')]
    assert first["id"].startswith("fc_") and first["call_id"].startswith("call_") and message["id"].startswith("msg_")
    usage = body["usage"]
    assert usage["input_tokens"] == 5 and usage["total_tokens"] == 5 + usage["output_tokens"]
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]


def test_gpt_oss_harmony_gives_a_reasoning_item_and_the_final_answer():
    harmony = ("<|channel|>analysis<|message|>Say hi.<|end|><|start|>assistant<|channel|>final<|message|>"
               "Hello!<|return|>")
    body = whole(request(), chunks_of(harmony, 4), ModelConfig(id="m", reasoning_parser="openai_gptoss"))
    SDKResponse.model_validate(body)
    reasoning, message = body["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Say hi."}]
    assert message["content"][0]["text"] == "Hello!"
    assert 0 < body["usage"]["output_tokens_details"]["reasoning_tokens"] < body["usage"]["output_tokens"]


def test_stream_events_are_typed_ordered_and_assemble_to_the_whole_response():
    model = ModelConfig(id="m", reasoning_parser="deepseek_r1")
    req = request(tools=[ADD], stream=True)
    events = streamed(req, chunks_of(THINKING_CALLS, 3), model)
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert all(name == e["type"] for name, e in events)
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-1] == "response.completed"
    state = ResponseStreamState(input_tools=[ADD], text_format=omit)
    for _, event in events:
        state.handle_event(EVENTS.validate_python(event))  # the SDK's types and its stream assembly
    final = events[-1][1]["response"]
    assert without_ids(final) == without_ids(whole(req, chunks_of(THINKING_CALLS, 3), model))
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    text = "".join(e["delta"] for name, e in events if name == "response.output_text.delta")
    assert text == final["output"][1]["content"][0]["text"] == "\nSure."
    arguments = [e["arguments"] for name, e in events if name == "response.function_call_arguments.done"]
    assert arguments == ['{"a": 1}', '{"a": 2}']
    # The arguments stream as written: several pieces per call, joining to the whole.
    first_call = final["output"][2]["id"]
    pieces = [e["delta"] for name, e in events
              if name == "response.function_call_arguments.delta" and e["item_id"] == first_call]
    assert len(pieces) > 1 and "".join(pieces) == '{"a": 1}'


def test_a_call_cut_by_the_cap_is_not_output_and_its_streamed_item_closes_incomplete():
    cut = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "add", "arguments": {"a'
    model = ModelConfig(id="m")  # hermes calls
    req = request(tools=[ADD], tool_choice="required", max_output_tokens=40)
    body = whole(req, chunks_of(cut, 4, reason="length"), model)
    assert body["status"] == "incomplete"
    assert [(i["type"], i["arguments"]) for i in body["output"] if i["type"] == "function_call"] == \
        [("function_call", '{"a": 1}')]
    assert "<tool_call>" not in json.dumps(body)
    events = streamed(request(tools=[ADD], tool_choice="required", stream=True), chunks_of(cut, 4, reason="length"),
                      model)
    done = [e["item"] for name, e in events if name == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert [(i["status"], i["arguments"]) for i in done] == [("completed", '{"a": 1}'), ("incomplete", '{"a')]
    assert [i["type"] for i in events[-1][1]["response"]["output"]] == [i["type"] for i in body["output"]]
    for _, event in events:
        EVENTS.validate_python(event)


def test_cut_answer_is_incomplete_and_whitespace_only_text_is_kept_without_calls():
    body = whole(request(max_output_tokens=3), chunks_of("  \n", 1, reason="length"))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = body["output"]
    assert message["status"] == "incomplete" and message["content"][0]["text"] == "  \n"
    events = streamed(request(stream=True), chunks_of("Hi", 1, reason="length"))
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_worker_error_after_the_start_is_an_error_event_then_failed():
    chunks = chunks_of("Hello", 2)
    chunks[-1] = GenerationChunk(error=ErrorInfo(503, "worker gone", type="server_error", code="worker_failed"))
    events = streamed(request(stream=True), chunks)
    (error_name, error), (failed_name, failed) = events[-2:]
    assert (error_name, error["code"], error["message"]) == ("error", "worker_failed", "worker gone")
    assert failed_name == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "worker gone"}
    for _, event in events:
        EVENTS.validate_python(event)


# ------------------------------------------------------------------------------ store

def test_store_keeps_conversations_bounded_and_least_recently_used():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    responses = [builder(request()).response("completed").model_copy(update={"id": f"resp_{i}"}) for i in range(3)]
    for i, response in enumerate(responses[:2]):
        store.put(response, [{"role": "user", "content": str(i)}])
    store.get("resp_0")  # now the most recently used
    store.put(responses[2], [])
    assert store.get("resp_0").messages() == [{"role": "user", "content": "0"}]
    with pytest.raises(APIError) as info:
        store.get("resp_1")
    assert (info.value.status, info.value.param) == (404, "previous_response_id")
    tiny = ResponseStore(max_entries=10, max_bytes=100)
    tiny.put(responses[0], [])  # larger than the whole store: not kept
    assert len(tiny) == 0


def test_output_items_continue_as_chat_messages():
    body = whole(request(tools=[ADD]), chunks_of(THINKING_CALLS, 5), ModelConfig(id="m", reasoning_parser="deepseek_r1"))
    items = SDKResponse.model_validate(body).output
    from serve_app.dialects.responses.response import Response
    messages = output_messages(Response.model_validate(body).output)
    assert len(items) == 4 and len(messages) == 1
    assert messages[0]["content"] == "\nSure." and [c["function"]["arguments"] for c in messages[0]["tool_calls"]] == [
        '{"a": 1}', '{"a": 2}']


# ------------------------------------------------------------- vLLM's structured outputs

@pytest.mark.parametrize(("fields", "kind", "param"), [
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "lark", "structured_outputs.choice"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "json_schema", "structured_outputs.json"),
    ({"guided_regex": "[0-9]+"}, "regex", "guided_regex"),
    ({"guided_grammar": 'start: "x"'}, "lark", "guided_grammar"),
])
def test_structured_output_fields_constrain_the_answer_as_on_chat(fields, kind, param):
    guided = chat_generate_request(to_chat_request(request(**fields)), "r").params.guided
    assert (guided.kind, guided.param) == (kind, param)


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "text": {"format": {"type": "json_object"}}}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar"),
])
def test_broken_structured_outputs_are_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as info:
        chat_generate_request(to_chat_request(request(**fields)), "r")
    assert (info.value.status, info.value.param) == (400, param), info.value.message
