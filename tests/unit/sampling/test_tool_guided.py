"""Forced tool calls end to end in the engine, on the tiny random model: the request goes
through the /v1 translation (grammar from serve_app/output/tool_parsers.py), the worker's
request processor and guided engine, and back through the /v1 accumulator. The weights
are random, so every valid call below is valid only because the grammar made it so."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from serve_app.dialects.chat.output import CompletionAccumulator
from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.translate import to_generate_request
from serve_app.output.choice_parser import OutputParsing
from tests.support.engines import generate, make_engine, with_async_engine
from workers.contract.model_config import ModelConfig
from workers.serving.request_processor import RequestProcessor

ORDER = {"type": "function", "function": {
    "name": "get_delivery_date", "strict": True,
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string", "maxLength": 6}},
                   "required": ["order_id"], "additionalProperties": False}}}
SHIP = {"type": "function", "function": {
    "name": "ship", "parameters": {
        "type": "object",
        "properties": {"speed": {"enum": ["slow", "fast"]}, "boxes": {"type": "integer", "minimum": 1, "maximum": 9},
                       "gift": {"type": "boolean"}},
        "required": ["speed", "boxes"], "additionalProperties": False}}}
TOOLS = [ORDER, SHIP]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED_SHIP = {"type": "function", "function": {"name": "ship"}}


def answer(engine_model, tokenizer, parser: str, seed: int, **fields):
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Where is my order 12345?"}],
        "tools": TOOLS, "temperature": 1.0, "seed": seed, "max_tokens": 96, **fields})
    model = ModelConfig(id="m", tool_call_parser=parser)
    request = to_generate_request(req, "r", model)
    assert request.params.guided is not None and request.params.guided.kind == "lark"
    # chatserve's tool section is long in the tiny 400-token vocabulary: a window past the 512 positions
    # the tiny model was configured with (RoPE has no hard limit; the weights are random anyway).
    engine = make_engine(engine_model, num_blocks=384, eos=frozenset({tokenizer.eos_token_id}), tokenizer=tokenizer,
                         max_model_len=1536)

    async def body(aengine):
        return [c async for c in generate(RequestProcessor(aengine, tokenizer), request)]

    accumulator = CompletionAccumulator("r", "m", 1, OutputParsing.of(req, model))
    for chunk in asyncio.run(with_async_engine(engine, body)):
        accumulator.add(chunk)
    return accumulator.result().choices[0]


def check_calls(choice, allowed: set[str]) -> list:
    calls = choice.message.tool_calls or []
    for call in calls:
        assert call.function.name in allowed
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("seed", range(4))
def test_required_single_call_is_always_one_valid_call(paged_model, tiny_tokenizer, parser, seed):
    choice = answer(paged_model, tiny_tokenizer, parser, seed, tool_choice="required", parallel_tool_calls=False)
    assert len(check_calls(choice, set(SCHEMAS))) == 1, choice.message
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("seed", range(4))
def test_named_function_is_always_that_function_with_valid_arguments(paged_model, tiny_tokenizer, parser, seed):
    choice = answer(paged_model, tiny_tokenizer, parser, seed, tool_choice=NAMED_SHIP)
    calls = check_calls(choice, {"ship"})
    assert len(calls) == 1 and choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("seed", range(3))
def test_required_parallel_calls_are_all_valid(paged_model, tiny_tokenizer, seed):
    choice = answer(paged_model, tiny_tokenizer, "hermes", seed, tool_choice="required")
    calls = check_calls(choice, set(SCHEMAS))
    assert calls  # the grammar forces at least one, complete before any second one starts
    assert choice.finish_reason in ("tool_calls", "length")
