"""Per-field behaviour of /v1/chat/completions through Serve and the official openai client."""

from __future__ import annotations

import math

import openai
import pytest

from tests.support.serve_fixtures import TINY_MODEL_ID

MESSAGES = [{"role": "user", "content": "Paris is the capital of France."}]


@pytest.fixture(scope="module")
def client(tiny_app):
    return openai.OpenAI(base_url=tiny_app + "/v1", api_key="unused", max_retries=0)


def create(client, **kw):
    kw.setdefault("extra_body", {}).setdefault("ignore_eos", True)
    return client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, **kw)


def test_n_gives_n_distinct_choices(client):
    out = create(client, n=3, temperature=1.5, max_tokens=8, seed=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) == 3
    assert out.usage.completion_tokens == 3 * 8
    again = create(client, n=3, temperature=1.5, max_tokens=8, seed=3)
    assert [c.message.content for c in again.choices] == texts


def test_streamed_n_choices_assemble(client):
    whole = create(client, n=2, temperature=1.2, max_tokens=6, seed=5)
    stream = create(client, n=2, temperature=1.2, max_tokens=6, seed=5, stream=True)
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {0: "length", 1: "length"}


def test_logprobs_shape_and_values(client):
    out = create(client, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(entry.logprob, tops[0], abs_tol=1e-5)
        assert entry.bytes == list(entry.token.encode("utf-8"))
    assert "".join(e.token for e in content) == out.choices[0].message.content


def test_prompt_logprobs_cover_the_prompt(client):
    out = create(client, temperature=0, max_tokens=2, extra_body={"prompt_logprobs": 1})
    scored = out.model_extra["prompt_logprobs"]
    assert scored[0] is None
    assert len(scored) == out.usage.prompt_tokens
    assert all(1 <= len(entry) <= 2 for entry in scored[1:])


def test_logit_bias_forces_a_token(client, tiny_tokenizer):
    token = next(i for i in range(300, 400) if tiny_tokenizer.decode([i]).strip().isalpha())
    out = create(client, temperature=0, max_tokens=4, logit_bias={str(token): 100})
    assert out.choices[0].message.content == tiny_tokenizer.decode([token] * 4)


def test_penalties_change_greedy_output(client):
    plain = create(client, temperature=0, max_tokens=40).choices[0].message.content
    penalised = create(client, temperature=0, max_tokens=40, frequency_penalty=2.0).choices[0].message.content
    assert plain != penalised


def test_min_tokens_holds_back_a_stop_token(client):
    everything = list(range(400))
    first = create(client, temperature=0, max_tokens=6, extra_body={"stop_token_ids": everything})
    assert first.usage.completion_tokens == 1
    first_id = first.choices[0].model_extra["stop_reason"]  # the stop token that ended it
    out = create(client, temperature=0, max_tokens=6, extra_body={"min_tokens": 3, "stop_token_ids": [first_id]})
    assert out.usage.completion_tokens >= 3


def test_beam_search_through_the_api(client):
    out = create(client, n=2, temperature=0, max_tokens=6,
                 extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 1.0, "top_k": -1})
    assert [c.index for c in out.choices] == [0, 1]
    texts = [c.message.content for c in out.choices]
    assert texts[0] != texts[1]
    assert all(c.finish_reason == "length" for c in out.choices)
    again = create(client, n=2, temperature=0, max_tokens=6, extra_body={"use_beam_search": True, "best_of": 3})
    assert [c.message.content for c in again.choices] == texts  # deterministic


def test_unknown_fields_are_ignored(tiny_app):
    """Documented choice (README): unknown request fields are ignored, as vLLM does."""
    import httpx

    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 2, "no_such_field": {"x": 1},
            "another_vendor_extra": True}
    resp = httpx.post(tiny_app + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= 2


def test_continuous_usage_stats_on_every_chunk(client):
    chunks = list(create(client, temperature=0, max_tokens=5, stream=True,
                         stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
