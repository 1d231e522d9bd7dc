"""/v1/responses over HTTP with the official clients: the OpenAI Python SDK on the tiny app
(text, instructions, structured output, streams, stored responses, errors), and on a tiny
model with room for tools, function calls and an OpenAI Agents SDK agent that calls one."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
)
from tests.support.tools_app import TOOLS_MODEL

SHIP = {"type": "function", "name": "ship", "description": "Ship an order.", "strict": True,
        "parameters": {"type": "object", "properties": {"speed": {"enum": ["slow", "fast"]}},
                       "required": ["speed"], "additionalProperties": False}}
CHOICE = {"type": "object", "properties": {"role": {"enum": ["admin", "user"]},
                                           "level": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["role", "level"], "additionalProperties": False}


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


# ------------------------------------------------------------------------ the tiny app

def test_string_input_with_instructions(tiny_app):
    out = client_for(tiny_app).responses.create(model=TINY_MODEL_ID, input="Say hi.", instructions="Be brief.",
                                                max_output_tokens=6, temperature=0, metadata={"case": "1"})
    assert out.id.startswith("resp_") and out.object == "response" and out.model == TINY_MODEL_ID
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    [message] = out.output
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "incomplete"
    assert out.output_text == message.content[0].text and out.output_text
    assert out.usage.output_tokens == 6 and out.usage.total_tokens == out.usage.input_tokens + 6
    assert out.instructions == "Be brief." and out.metadata == {"case": "1"} and out.store is True


def test_json_schema_text_format_constrains_the_answer(tiny_app):
    out = client_for(tiny_app).responses.create(
        model=TINY_MODEL_ID, input="Pick a role.", max_output_tokens=64, temperature=1.0, extra_body={"seed": 3},
        text={"format": {"type": "json_schema", "name": "choice", "schema": CHOICE, "strict": True}})
    assert out.status == "completed", out.output_text
    jsonschema.validate(json.loads(out.output_text), CHOICE)
    assert out.text.format.type == "json_schema"


def test_stream_events_in_order_and_equal_to_the_greedy_response(tiny_app):
    client = client_for(tiny_app)
    # Structured output ends the answer (the grammar's end), so the stream ends with
    # response.completed, which the SDK's stream helper needs for its final response.
    kwargs = dict(model=TINY_MODEL_ID, input=[{"role": "user", "content": "Pick a role."}], max_output_tokens=64,
                  temperature=0, text={"format": {"type": "json_schema", "name": "choice", "schema": CHOICE}})
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    names = [e.type for e in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    tokens = ("input_tokens", "output_tokens", "total_tokens")  # cached_tokens differ: the prefix cache
    assert [getattr(final.usage, k) for k in tokens] == [getattr(whole.usage, k) for k in tokens]
    assert final.status == whole.status == "completed"
    assert [(i.type, i.status, len(i.content)) for i in final.output] == [("message", "completed", 1)]
    assert [(i.type, i.status, len(i.content)) for i in whole.output] == [("message", "completed", 1)]


def test_previous_response_id_continues_a_stored_response(tiny_app):
    client = client_for(tiny_app)
    first = client.responses.create(model=TINY_MODEL_ID, input="Remember 7.", max_output_tokens=4, temperature=0)
    second = client.responses.create(model=TINY_MODEL_ID, input="Which number?", max_output_tokens=4,
                                     temperature=0, previous_response_id=first.id)
    alone = client.responses.create(model=TINY_MODEL_ID, input="Which number?", max_output_tokens=4,
                                    temperature=0, store=False)
    # The second prompt holds the first turn: its input and its answer.
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id and alone.store is False
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(alone.id)
    assert info.value.body["code"] == "response_not_found"


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "no-such-model", "input": "x"}, 404, "model"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, 400, "input.0.call_id"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": "x", "max_output_tokens": 100_000}, 400, "max_output_tokens"),
])
def test_errors_name_the_field(tiny_app, body, status, param):
    resp = httpx.post(tiny_app + "/v1/responses", json={"model": TINY_MODEL_ID, **body}, timeout=60)
    error = resp.json()["error"]
    assert (resp.status_code, error["type"], error["param"]) == (status, "invalid_request_error", param), error


# ------------------------------------------------------------------------- with tools

def test_required_tool_choice_gives_a_function_call_and_its_output_continues(tools_app):
    client = client_for(tools_app)
    # The tiny tokenizer spends about a token a character: a call is some 60 tokens.
    kwargs = dict(model=TOOLS_MODEL, tools=[SHIP], max_output_tokens=128, temperature=0)
    turn = client.responses.create(input="Ship my order fast.", tool_choice="required", parallel_tool_calls=False,
                                   **kwargs)
    [call] = [item for item in turn.output if item.type == "function_call"]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.name == "ship"
    jsonschema.validate(json.loads(call.arguments), SHIP["parameters"])
    assert turn.status == "completed" and turn.tool_choice == "required"

    with client.responses.stream(input="Ship my order fast.", tool_choice={"type": "function", "name": "ship"},
                                 parallel_tool_calls=False, **kwargs) as stream:
        events = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert events.index("response.function_call_arguments.delta") < events.index(
        "response.function_call_arguments.done") < events.index("response.completed")
    assert [(i.name, i.arguments) for i in streamed.output if i.type == "function_call"] == [
        (call.name, call.arguments)]

    history = [{"role": "user", "content": "Ship my order fast."},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "shipped"}]
    answer_kwargs = {**kwargs, "instructions": "Confirm shipments.", "tool_choice": "none", "max_output_tokens": 8}
    answer = client.responses.create(input=history, **answer_kwargs)
    assert [i.type for i in answer.output] == ["message"] and answer.output_text
    # The call and its output are in the prompt.
    assert answer.usage.input_tokens > client.responses.create(input=history[:1], **answer_kwargs).usage.input_tokens
    # The same conversation from the stored turn: the same prompt, the same greedy answer.
    continued = client.responses.create(input=history[2:], previous_response_id=turn.id, **answer_kwargs)
    assert (continued.usage.input_tokens, continued.output_text) == (answer.usage.input_tokens, answer.output_text)


def test_agents_sdk_agent_calls_a_function_tool_and_finishes(tools_app):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    shipped: list[str] = []

    class Confirmation(BaseModel):
        status: Literal["shipped", "late"]

    # Not strict: with tool_choice auto (the second turn) a strict function would need its
    # own grammar, and the answer's format (output_type) has one already.
    @function_tool(strict_mode=False)
    def ship(speed: Literal["slow", "fast"]) -> str:
        """Ship the order."""
        shipped.append(speed)
        return f"shipped {speed}"

    client = openai.AsyncOpenAI(base_url=tools_app + "/v1", api_key="unused", max_retries=0)
    agent = Agent(name="shipper", instructions="Ship orders.", tools=[ship], output_type=Confirmation,
                  model=OpenAIResponsesModel(model=TOOLS_MODEL, openai_client=client),
                  # Forced once: the SDK resets tool_choice after the call, so the next turn
                  # answers, as JSON (a random model ends only where a grammar ends it).
                  model_settings=ModelSettings(tool_choice="required", max_tokens=128, temperature=0))
    result = asyncio.run(Runner.run(agent, "Ship my order fast.", max_turns=3))
    assert len(shipped) == 1 and shipped[0] in ("slow", "fast")
    assert isinstance(result.final_output, Confirmation) and len(result.raw_responses) == 2
    assert [r.output[-1].type for r in result.raw_responses] == ["function_call", "message"]
