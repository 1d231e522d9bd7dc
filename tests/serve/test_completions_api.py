"""`/v1/completions` (legacy text completion): translation as unit tests, then the
official `openai` client and raw HTTP against the tiny model. The request rules are unit
tests in tests/unit/api/test_dialect_rules.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from serve_app.dialects.completions import (
    CompletionAccumulator,
    CompletionRequest,
    CompletionStreamer,
    to_generate_request,
)
from serve_app.http.errors import APIError
from tests.support.serve_fixtures import TINY_MODEL_ID
from tests.support.sse_events import sse_payloads
from workers.contract.chunks import ErrorInfo, GenerationChunk, TokenLogprob, TopLogprob

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPT = "The quick brown fox"


def make(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": TINY_MODEL_ID, "prompt": PROMPT, **fields})


# ------------------------------------------------------------------------ translation


def test_defaults():
    gen = to_generate_request(make(), "cmpl-1")
    assert gen.prompt == PROMPT and gen.messages is None
    assert gen.max_tokens == 16  # OpenAI's default
    p = gen.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == () and p.stop_token_ids == () and p.logit_bias == {}
    assert not p.ignore_eos and p.skip_special_tokens and not p.include_stop_str_in_output


def test_fields_map_to_sampling_params():
    gen = to_generate_request(
        make(max_tokens=7, temperature=0, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop="x", stop_token_ids=[4],
             ignore_eos=True, skip_special_tokens=False, include_stop_str_in_output=True, presence_penalty=0.5,
             frequency_penalty=-0.5, repetition_penalty=1.2, min_tokens=2, logit_bias={"11": -100, "12": 5}),
        "r",
    )
    p = gen.params
    assert gen.max_tokens == 7
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.0, 0.9, 5, 0.1, 3)
    assert p.stop == ("x",) and p.stop_token_ids == (4,)
    assert p.ignore_eos and not p.skip_special_tokens and p.include_stop_str_in_output
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.5, -0.5, 1.2, 2)
    assert p.logit_bias == {11: -100.0, 12: 5.0}


def test_null_max_tokens_is_the_rest_of_the_window():
    assert to_generate_request(make(max_tokens=None), "r").max_tokens is None


def test_a_list_of_one_prompt_is_that_prompt():
    assert make(prompt=["hello"]).prompt == "hello"


def test_n_best_of_beam_and_logprobs_map_to_sampling_params():
    p = to_generate_request(make(n=3), "r").params
    assert (p.n, p.logprobs, p.use_beam_search) == (3, None, False)
    p = to_generate_request(make(n=2, best_of=5), "r").params
    assert (p.n, p.logprobs) == (5, 0)  # ranking needs each sample's logprobs
    p = to_generate_request(make(logprobs=3), "r").params
    assert (p.n, p.logprobs) == (1, 3)
    p = to_generate_request(make(n=2, best_of=4, use_beam_search=True, temperature=0, length_penalty=0.5), "r").params
    assert (p.n, p.best_of, p.beam_width, p.use_beam_search, p.temperature, p.length_penalty) == (2, 4, 4, True, 0.0, 0.5)


def _lp(token: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(token, 0, logprob, [TopLogprob(token, 0, logprob), TopLogprob("z", 1, logprob - 1)])


def test_best_of_keeps_the_n_most_likely_choices_and_hides_unasked_logprobs():
    acc = CompletionAccumulator("cmpl-1", make(n=2, best_of=3))
    for index, (text, logprob) in enumerate([("low", -5.0), ("high", -0.5), ("mid", -1.0)]):
        acc.add(GenerationChunk(index=index, text=text, logprobs=[_lp(text, logprob)], finish_reason="length",
                                prompt_tokens=4, completion_tokens=index + 1))
    body = acc.result().dump()
    assert [(c["index"], c["text"], c["logprobs"]) for c in body["choices"]] == [(0, "high", None), (1, "mid", None)]
    assert body["usage"]["completion_tokens"] == 3  # every sample counts


def test_legacy_logprobs_shape_with_offsets():
    acc = CompletionAccumulator("cmpl-1", make(logprobs=1))
    acc.add(GenerationChunk(text="ab", logprobs=[_lp("a", -0.1), _lp("b", -0.2)], prompt_tokens=4, completion_tokens=2))
    acc.add(GenerationChunk(text="c", logprobs=[_lp("c", -0.3)], finish_reason="length", prompt_tokens=4,
                            completion_tokens=3))
    lp = acc.result().dump()["choices"][0]["logprobs"]
    assert lp == {"tokens": ["a", "b", "c"], "token_logprobs": [-0.1, -0.2, -0.3],
                  "top_logprobs": [{"a": -0.1, "z": -1.1}, {"b": -0.2, "z": -1.2}, {"c": -0.3, "z": -1.3}],
                  "text_offset": [0, 1, 2]}


def test_stream_interleaves_choices_and_carries_logprobs():
    streamer = CompletionStreamer("cmpl-1", make(n=2, logprobs=0, stream=True))
    chunks = [GenerationChunk(index=0, text="a", logprobs=[_lp("a", -0.1)]),
              GenerationChunk(index=1, text="x", logprobs=[_lp("x", -0.4)]),
              GenerationChunk(index=1, text="y", logprobs=[_lp("y", -0.5)], finish_reason="length"),
              GenerationChunk(index=0, text="b", logprobs=[_lp("b", -0.2)], finish_reason="length")]
    events = sse_payloads(streamer, chunks)
    got = [(e["choices"][0]["index"], e["choices"][0]["text"], e["choices"][0]["logprobs"]["text_offset"])
           for e in events]
    assert got == [(0, "a", [0]), (1, "x", [0]), (1, "y", [1]), (0, "b", [1])]


def test_echo_and_stream_shapes():
    chunks = [GenerationChunk(text="", prompt_tokens=4, completion_tokens=1),
              GenerationChunk(text=" jumps", prompt_tokens=4, completion_tokens=2),
              GenerationChunk(text=".", finish_reason="length", prompt_tokens=4, completion_tokens=3)]
    acc = CompletionAccumulator("c", make(echo=True))
    for chunk in chunks:
        acc.add(chunk)
    body = json.loads(acc.result().dump_json())
    assert body["choices"] == [{"index": 0, "text": PROMPT + " jumps.", "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}]
    streamer = CompletionStreamer("c", make(echo=True, stream=True, stream_options={"include_usage": True}))
    payloads = sse_payloads(streamer, chunks)
    assert [p["choices"][0]["text"] for p in payloads[:-1]] == [PROMPT, " jumps", "."]
    assert all(p["usage"] is None for p in payloads[:-1])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 3

    payloads = sse_payloads(CompletionStreamer("c", make(stream=True)), chunks)
    assert all("usage" not in p for p in payloads)  # no include_usage: no usage key at all


def test_worker_errors_name_prompt():
    acc = CompletionAccumulator("c", make())
    with pytest.raises(APIError) as info:
        acc.add(GenerationChunk(error=ErrorInfo(400, "the prompt is empty after tokenization", param="messages")))
    assert info.value.param == "prompt"


# ------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def client(tiny_app):
    return openai.OpenAI(base_url=tiny_app + "/v1", api_key="unused", max_retries=0)


def post(url: str, body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_openai_client_non_streaming(client, tiny_tokenizer):
    out = client.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == TINY_MODEL_ID
    (choice,) = out.choices
    assert choice.index == 0 and choice.logprobs is None and choice.finish_reason == "length"
    assert isinstance(choice.text, str) and choice.text
    expected_prompt = len(tiny_tokenizer(PROMPT, add_special_tokens=True)["input_ids"])
    assert out.usage.prompt_tokens == expected_prompt
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == expected_prompt + 5


def test_openai_client_n_logprobs_best_of_and_beams(client):
    out = client.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=4, n=2, seed=1, logprobs=2,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.completion_tokens == 8
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert all(len(top) <= 2 for top in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    best = client.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=4, best_of=3, seed=2,
                                     extra_body={"ignore_eos": True})
    assert len(best.choices) == 1 and best.choices[0].logprobs is None and best.usage.completion_tokens == 12
    beams = client.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=4, n=2, temperature=0,
                                      extra_body={"use_beam_search": True, "ignore_eos": True})
    assert sorted(c.index for c in beams.choices) == [0, 1] and beams.choices[0].text != beams.choices[1].text


def test_a_list_of_prompts_answers_each_with_its_own_choices(client, tiny_tokenizer):
    """Each prompt is its own worker call: prompt p's choice i is index p * n + i, each the
    text that prompt alone gives (greedy), and usage counts every prompt; streamed the same."""
    prompts = ["The quick brown fox", [5, 9, 13, 7], "Hello there"]
    kwargs = dict(model=TINY_MODEL_ID, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]
    out = client.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2] and [c.text for c in out.choices] == alone
    prompt_tokens = sum(len(tiny_tokenizer(p)["input_ids"]) if isinstance(p, str) else len(p) for p in prompts)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 12)
    streamed: dict[int, str] = {}
    chunks = list(client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == dict(enumerate(alone)) and chunks[-1].usage.completion_tokens == 12
    sampled = client.completions.create(model=TINY_MODEL_ID, prompt=["a b", "c d"], max_tokens=3, n=2, seed=4,
                                        echo=True, extra_body={"ignore_eos": True})
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3] and sampled.usage.completion_tokens == 12
    assert [c.text[:3] for c in sampled.choices] == ["a b", "a b", "c d", "c d"]


def test_default_max_tokens_is_16(client):
    out = client.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_openai_client_streaming_matches(client):
    kwargs = dict(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # cached_tokens may differ: the second request finds the first one's prompt in the prefix cache.
    assert chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(
        exclude={"prompt_tokens_details"})


def test_echo_prepends_the_prompt(client):
    kwargs = dict(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=4, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    echoed = client.completions.create(echo=True, **kwargs).choices[0].text
    assert echoed == PROMPT + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(echo=True, stream=True, **kwargs))
    assert streamed == PROMPT + plain


def test_stop_string_and_seed(client):
    base = dict(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**base).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = client.completions.create(stop=[stop], **base).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == stop
    seeded = dict(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})
    assert client.completions.create(**seeded).choices[0].text == client.completions.create(**seeded).choices[0].text


def test_raw_sse(tiny_app):
    body = {"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", tiny_app + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert all(set(p["choices"][0]) >= {"index", "text", "finish_reason"} for p in payloads)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT}, "model"),
        ({"model": TINY_MODEL_ID}, "prompt"),
        ({"model": TINY_MODEL_ID, "prompt": ""}, "prompt"),
        ({"model": TINY_MODEL_ID, "prompt": [1, -2, 3]}, "prompt"),
        ({"model": TINY_MODEL_ID, "prompt": [[1, 2], []]}, "prompt"),  # an empty prompt in a list
        ({"model": TINY_MODEL_ID, "prompt": ["a"] * 65}, "prompt"),  # more than MAX_PROMPTS
        ({"model": TINY_MODEL_ID, "prompt": [[1, 2], [3, 10**9]]}, "prompt"),  # outside the vocabulary
        ({"model": TINY_MODEL_ID, "prompt": ["a", [1, 2]], "echo": True}, "echo"),
        ({"model": TINY_MODEL_ID, "prompt": PROMPT, "suffix": "x"}, "suffix"),
        ({"model": TINY_MODEL_ID, "prompt": PROMPT, "n": 2, "temperature": 0}, "n"),
        ({"model": TINY_MODEL_ID, "prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ({"model": TINY_MODEL_ID, "prompt": PROMPT, "best_of": 2, "stream": True}, "best_of"),
        ({"model": TINY_MODEL_ID, "prompt": PROMPT, "temperature": 3}, "temperature"),
        ({"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"model": TINY_MODEL_ID, "prompt": PROMPT, "logit_bias": {"100000": 1}}, "logit_bias"),
        ({"model": TINY_MODEL_ID, "prompt": PROMPT, "logit_bias": {"5": 200}}, "logit_bias"),
        ({"model": TINY_MODEL_ID, "prompt": PROMPT, "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
        ({"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": 1000}, "max_tokens"),  # over the window (worker)
    ],
)
def test_invalid_requests(tiny_app, body, param):
    resp = post(tiny_app, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_a_token_id_prompt_answers_as_its_text_does(client, tiny_tokenizer):
    """The worker feeds the ids as they are; the text's own tokenization gives the same answer."""
    ids = tiny_tokenizer(PROMPT)["input_ids"]
    want = client.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0)
    for prompt in (ids, [ids]):
        got = client.completions.create(model=TINY_MODEL_ID, prompt=prompt, max_tokens=6, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.prompt_tokens == want.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(("prompt", "extra", "param", "words"), [
    ([1, 2, 10**6], {}, "prompt", "outside this model's vocabulary"),
    ([1, 2, 3], {"echo": True}, "echo", "echo needs text prompts"),
    ([[1, 2], [3, 10**6]], {}, "prompt", "outside this model's vocabulary"),  # the second of a list
    ([], {}, "prompt", "a list of 1 to 64 prompts"),
])
def test_token_id_prompts_that_cannot_run_are_400(tiny_app, prompt, extra, param, words):
    resp = post(tiny_app, {"model": TINY_MODEL_ID, "prompt": prompt, **extra})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT)
