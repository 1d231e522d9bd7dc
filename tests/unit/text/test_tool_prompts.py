"""Worker-side prompts with tools (workers/text/prompts.py): a tool-aware template gets `tools=`,
a template that ignores tools gets chatserve's own section; earlier calls and tool results
render either way; a template that opens `<think>` is reported on the chunks."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.translate import to_generate_request
from tests.support.engines import generate, make_engine, with_async_engine
from workers.contract.model_config import ModelConfig
from workers.serving.request_processor import RequestProcessor
from workers.text.prompts import PromptBuilder

# A tiny tool-aware template in the style of Qwen's: tools in the system turn, calls as
# `arguments | tojson` (so it needs the arguments as an object), tool results as turns.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A thinking model's template: the generation prompt opens the reasoning unless asked not to.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)

DELIVERY = {"type": "function", "function": {
    "name": "get_delivery_date", "description": "Get the delivery date for a customer's order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}
CONVERSATION = [
    {"role": "system", "content": "You are a helpful customer support assistant."},
    {"role": "user", "content": "When does order 12345 arrive?"},
    {"role": "assistant", "tool_calls": [{"id": "tool_call_8p2Nk", "type": "function",
                                          "function": {"name": "get_delivery_date", "arguments": "{\"order_id\": \"12345\"}"}}]},
    {"role": "tool", "content": "the delivery date is 2024.09.10.", "tool_call_id": "tool_call_8p2Nk"},
]


def with_template(tokenizer, template: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def generate_request(messages, model: ModelConfig | None = None, **fields):
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})
    return to_generate_request(req, "r", model or ModelConfig(id="m"))


def test_tool_aware_template_gets_the_tools_and_argument_objects(tiny_tokenizer):
    builder = PromptBuilder(with_template(tiny_tokenizer, TOOL_TEMPLATE))
    assert builder.template_renders_tools
    text = builder.chat_text(generate_request(CONVERSATION, tools=[DELIVERY]))
    assert text.startswith("<|im_start|>system\nTOOLS: get_delivery_date<|im_end|>")
    assert 'CALL get_delivery_date {"order_id": "12345"}' in text  # an object, not JSON text encoded twice
    assert "<|im_start|>tool\nthe delivery date is 2024.09.10.<|im_end|>" in text
    assert "<tools>" not in text  # chatserve's own section is not added


def test_template_without_tools_gets_chatservers_own_section(tiny_tokenizer):
    builder = PromptBuilder(tiny_tokenizer)
    assert not builder.template_renders_tools
    text = builder.chat_text(generate_request(CONVERSATION[:2], tools=[DELIVERY]))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a helpful customer support assistant.\n\n# Tools")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(listed) == DELIVERY
    assert "<tool_call>" in system  # the calling convention the hermes parser reads


def test_history_with_calls_and_results_renders_as_text(tiny_tokenizer):
    text = PromptBuilder(tiny_tokenizer).chat_text(generate_request(CONVERSATION, tools=[DELIVERY]))
    call = '<|im_start|>assistant\n<tool_call>\n{"name": "get_delivery_date", "arguments": {"order_id": "12345"}}\n</tool_call><|im_end|>'
    assert call in text
    assert "<|im_start|>user\n<tool_response>\nthe delivery date is 2024.09.10.\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama3_json_models_are_taught_their_own_format(tiny_tokenizer):
    request = generate_request(CONVERSATION, ModelConfig(id="m", tool_call_parser="llama3_json"), tools=[DELIVERY])
    text = PromptBuilder(tiny_tokenizer).chat_text(request)
    assert '"parameters": <args-json-object>' in text
    assert '<|im_start|>assistant\n{"name": "get_delivery_date", "parameters": {"order_id": "12345"}}<|im_end|>' in text


def test_tool_choice_none_shows_no_tools(tiny_tokenizer):
    text = PromptBuilder(tiny_tokenizer).chat_text(generate_request(CONVERSATION[:2], tools=[DELIVERY], tool_choice="none"))
    assert "get_delivery_date" not in text


def test_template_kwargs_reach_the_template(tiny_tokenizer):
    builder = PromptBuilder(with_template(tiny_tokenizer, THINK_TEMPLATE))
    messages = [{"role": "user", "content": "9.11 or 9.8?"}]
    assert builder.chat_text(generate_request(messages)).endswith("<think>\n")
    off = generate_request(messages, chat_template_kwargs={"enable_thinking": False})
    assert builder.chat_text(off).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(("kwargs", "opened"), [({}, True), ({"enable_thinking": False}, False)])
def test_chunks_report_a_prompt_that_opens_the_reasoning(paged_model, tiny_tokenizer, kwargs, opened):
    tokenizer = with_template(tiny_tokenizer, THINK_TEMPLATE)
    request = generate_request([{"role": "user", "content": "hi"}], ModelConfig(id="m", reasoning_parser="deepseek_r1"),
                               chat_template_kwargs=kwargs, max_tokens=3, temperature=0)

    async def body(aengine):
        return [c async for c in generate(RequestProcessor(aengine, tokenizer), request)]

    chunks = asyncio.run(with_async_engine(make_engine(paged_model, max_model_len=256), body))
    assert chunks and all(c.error is None for c in chunks)
    assert all(c.reasoning_open is opened for c in chunks)
