"""The chat stream's deltas as clients assemble them: `role` once per choice, tool-call
arguments in pieces that add up to the non-streamed ones, no call markup as content
(serve_app/dialects/chat/output.py over recorded worker chunks, no server)."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionChunk as SDKChunk

from serve_app.dialects.chat.output import ChunkStreamer, CompletionAccumulator
from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.output.call_deltas import CallAssembly
from serve_app.output.choice_parser import OutputParsing
from serve_app.output.tool_parsers import HermesToolParser
from serve_app.schema.tools import Tool
from tests.support.sse_events import sse_payloads
from workers.contract.chunks import GenerationChunk
from workers.contract.model_config import ModelConfig

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
MODEL = ModelConfig(id="m")
TWO_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "note": "x}<y"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"b": [2, {"c": 3}]}}\n</tool_call>')


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def chunks_of(text: str, size: int, reason: str = "stop", index: int = 0) -> list[GenerationChunk]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    chunks = [GenerationChunk(index=index, text=p, token_ids=[7], prompt_tokens=5, completion_tokens=i + 1)
              for i, p in enumerate(pieces)]
    chunks[-1].finish_reason = reason
    return chunks


def whole(req: ChatCompletionRequest, chunks: list[GenerationChunk]) -> dict:
    acc = CompletionAccumulator("r", "m", req.n, OutputParsing.of(req, MODEL))
    for chunk in chunks:
        acc.add(chunk)
    return json.loads(acc.result().dump_json())


def streamed(req: ChatCompletionRequest, chunks: list[GenerationChunk]) -> list[dict]:
    events = sse_payloads(ChunkStreamer("r", req, False, OutputParsing.of(req, MODEL)), chunks)
    for event in events:
        SDKChunk.model_validate(event)
    return [e for e in events if e["choices"]]


def assembled_calls(events: list[dict]) -> dict[int, dict]:
    """Calls put together the way OpenAI's SDKs do, checking each delta's shape."""
    calls: dict[int, dict] = {}
    for event in events:
        for call in event["choices"][0]["delta"].get("tool_calls") or []:
            if call["index"] not in calls:
                assert set(call) == {"index", "id", "type", "function"} and set(call["function"]) == {"name", "arguments"}
                calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"],
                                        "pieces": [call["function"]["arguments"]]}
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["pieces"].append(call["function"]["arguments"])
    return calls


@pytest.mark.parametrize("size", [1, 3, 16, 1000])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_arguments_add_up_to_the_whole_answers(size, choice):
    chunks = chunks_of(TWO_CALLS, size)
    message = whole(request(tools=[ADD], tool_choice=choice), chunks)["choices"][0]["message"]
    events = streamed(request(tools=[ADD], tool_choice=choice, stream=True), chunks)
    calls = assembled_calls(events)
    assert [(c["name"], "".join(c["pieces"])) for c in calls.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "note": "x}<y"}'
    assert message["content"] is None and not any(e["choices"][0]["delta"].get("content") for e in events)
    if size == 1:  # a character a chunk: the arguments go out as they come, not at the end
        assert all(len(c["pieces"]) > 10 for c in calls.values())
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "tool_calls"


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_forced_call_cut_by_length_leaks_no_markup(choice):
    """The default model's case: one whole call, the second cut by max_tokens."""
    cut = TWO_CALLS[:TWO_CALLS.rindex('"b"')]
    for size in (1, 5, 1000):
        chunks = chunks_of(cut, size, reason="length")
        body = whole(request(tools=[ADD], tool_choice=choice), chunks)
        choice_out = body["choices"][0]
        assert choice_out["finish_reason"] == "length" and choice_out["message"]["content"] is None
        assert [c["function"]["arguments"] for c in choice_out["message"]["tool_calls"]] == ['{"a": 1, "note": "x}<y"}']
        events = streamed(request(tools=[ADD], tool_choice=choice, stream=True), chunks)
        assert not any(e["choices"][0]["delta"].get("content") for e in events)
        assert not any("tool_call>" in json.dumps(e) for e in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("parsing", [False, True])
def test_the_role_is_in_each_choices_first_delta_only(parsing):
    """With and without parsers (the template path and the models path), n = 2 interleaved."""
    fields = dict(n=2, stream=True, **({"tools": [ADD]} if parsing else {}))
    a, b = chunks_of("Hello there, how are you?", 4, index=0), chunks_of("Fine words here", 3, index=1)
    interleaved = [c for pair in zip(a, b) for c in pair] + a[len(b):] + b[len(a):]
    events = streamed(request(**fields), interleaved)
    for index, text in ((0, "Hello there, how are you?"), (1, "Fine words here")):
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"][0]["index"] == index]
        assert [d.get("role") for d in deltas] == ["assistant"] + [None] * (len(deltas) - 1)
        assert "".join(d.get("content") or "" for d in deltas) == text


def test_the_role_goes_with_the_first_delta_even_when_that_is_a_call():
    events = streamed(request(tools=[ADD], tool_choice="required", stream=True), chunks_of(TWO_CALLS, 7))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant" and "tool_calls" in deltas[0]
    assert all("role" not in d for d in deltas[1:])


def test_readers_of_whole_calls_get_each_once_it_completes():
    parser, assembly, completed = HermesToolParser([Tool.model_validate(ADD)]), CallAssembly(), []
    for i in range(0, len(TWO_CALLS), 5):
        completed.append([(c.name, c.arguments) for c in assembly.add(parser.push(TWO_CALLS[i:i + 5]).calls)])
    completed.append([(c.name, c.arguments) for c in assembly.add(parser.finish().calls)])
    done = [c for batch in completed for c in batch]
    assert done == [("add", '{"a": 1, "note": "x}<y"}'), ("add", '{"b": [2, {"c": 3}]}')]
    assert not completed[0] and not completed[-1]  # each came with the piece that closed it
