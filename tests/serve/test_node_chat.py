"""Chat streams as OpenAI's Node SDK reads them (tests/clients/node/chat_stream.mjs, on the
shared tools app): `role` in the first delta only, tool-call arguments streamed in pieces
that join to the unstreamed ones, no call markup as content when calls are forced (also when
max_tokens cuts them), logprobs of the content's tokens only; and, through the Python
client, logprobs cut with a stop string or stop token like the text."""

from __future__ import annotations

import json

import openai
import pytest

from tests.support.tools_app import TOOLS_MODEL

USER = [{"role": "user", "content": "Ship my order fast."}]


@pytest.fixture(scope="module")
def node_run(node_sdk, tools_app) -> dict:
    return node_sdk.run("chat_stream.mjs", f"{tools_app}/v1", TOOLS_MODEL)


def content_of(events: list[dict]) -> str:
    return "".join(e["delta"].get("content") or "" for e in events)


@pytest.mark.parametrize("case", ["required", "cut", "logprobs"])
def test_role_in_the_first_delta_only(node_run, case):
    roles = [e["delta"].get("role") for e in node_run[case]["stream"]]
    assert roles[0] == "assistant" and not any(roles[1:]), roles


def test_streamed_arguments_join_to_the_unstreamed_ones(node_run):
    events, whole = node_run["required"]["stream"], node_run["required"]["whole"]
    [call] = whole["message"]["tool_calls"]
    pieces = [c for e in events for c in e["delta"].get("tool_calls") or []]
    head, rest = pieces[0], pieces[1:]
    assert (head["index"], head["type"], head["function"]["name"]) == (0, "function", "ship")
    assert head["id"].startswith("call_") and "arguments" in head["function"]
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in rest), rest
    assert len(rest) > 1  # piece by piece, not whole
    assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
    json.loads(call["function"]["arguments"])
    assert [e["finish_reason"] for e in events if e["finish_reason"]] == [whole["finish_reason"]] == ["tool_calls"]
    assert whole["message"]["content"] is None and content_of(events) == ""


def test_forced_calls_cut_by_max_tokens_leak_no_markup(node_run):
    events, whole = node_run["cut"]["stream"], node_run["cut"]["whole"]
    assert whole["finish_reason"] == "length" and events[-1]["finish_reason"] == "length"
    assert whole["message"]["content"] is None and content_of(events) == ""
    assert "tool_call>" not in json.dumps(node_run["cut"])
    for call in whole["message"].get("tool_calls") or []:  # only whole calls, if any
        json.loads(call["function"]["arguments"])


def test_logprobs_list_the_content_tokens(node_run):
    events, whole = node_run["logprobs"]["stream"], node_run["logprobs"]["whole"]
    tokens = [t for e in events for t in e["logprobs"] or []]
    assert "".join(tokens) == content_of(events) == whole["message"]["content"]
    assert tokens == [entry["token"] for entry in whole["logprobs"]["content"]]


def _plain(tokens: list[str], start: int, count: int) -> bool:
    """The tokens around [start, start + count) are ASCII: no partial character of the random
    model's (invalid UTF-8) sits at the boundary, whose text the next token would carry."""
    return all(t.isascii() and t for t in tokens[start - 1:start + count + 1])


def test_stop_string_and_stop_token_cut_the_text_and_keep_every_generated_tokens_entry(tools_app, tiny_tokenizer):
    """One logprob entry per generated token, as usage counts them (vLLM's rule): the text
    stops before a stop string or a hidden stop token, their tokens' entries do not."""
    client = openai.OpenAI(base_url=tools_app + "/v1", api_key="unused", max_retries=0)
    # 16 tokens: this greedy answer ends on a whole character (a token cut mid-character has
    # an entry though the text cannot show it).
    kwargs = dict(model=TOOLS_MODEL, messages=USER, temperature=0, max_tokens=16, logprobs=True)
    free = client.chat.completions.create(**kwargs).choices[0]
    tokens = [e.token for e in free.logprobs.content]
    assert free.finish_reason == "length" and "".join(tokens) == free.message.content
    at = next(i for i in range(1, 13) if _plain(tokens, i, 2))
    stop = "".join(tokens[at:at + 2])  # a stop string over two tokens
    reply = client.chat.completions.create(stop=[stop], **kwargs)
    cut = reply.choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == free.message.content.split(stop)[0]
    entries = [e.token for e in cut.logprobs.content]
    assert entries == tokens[:len(entries)] and len(entries) == reply.usage.completion_tokens
    assert "".join(entries).startswith(cut.message.content + stop)  # the stop string's tokens have entries
    # A stop token (not shown): not in the text, in the logprobs as the last entry.
    at = next(i for i in range(1, 14) if _plain(tokens, i, 1)
              and len(tiny_tokenizer(tokens[i], add_special_tokens=False)["input_ids"]) == 1)
    [stop_id] = tiny_tokenizer(tokens[at], add_special_tokens=False)["input_ids"]
    first = tokens.index(tokens[at])
    reply = client.chat.completions.create(**kwargs, extra_body={"stop_token_ids": [stop_id]})
    by_id = reply.choices[0]
    assert (by_id.finish_reason, by_id.message.content) == ("stop", "".join(tokens[:first]))
    assert [e.token for e in by_id.logprobs.content] == tokens[:first + 1]
    assert reply.usage.completion_tokens == first + 1
