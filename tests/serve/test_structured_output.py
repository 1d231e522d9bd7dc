"""Structured output, `response_format` and vLLM's `structured_outputs` / `guided_*` fields
(serve_app/schema/structured_outputs.py): translation as unit tests, then through Serve
on the tiny random model, whose output fits only because the grammar mask makes it so.

The Serve tests start Ray: run this file under the shared lock (see README)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.translate import to_generate_request as chat_request
from serve_app.dialects.completions import CompletionRequest
from serve_app.dialects.completions import to_generate_request as completion_request
from serve_app.http.errors import APIError, validation_error
from serve_app.http.request_body import parse_request
from tests.support.serve_fixtures import TINY_MODEL_ID
from workers.contract.sampling_params import GuidedDecoding

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": TINY_MODEL_ID, "messages": MESSAGES, **fields})


# ------------------------------------------------------------------------ translation


def test_text_format_means_no_constraint():
    assert chat_request(chat(response_format={"type": "text"}), "r").params.guided is None
    assert chat_request(chat(), "r").params.guided is None


def test_json_object_and_json_schema_become_guided_decoding():
    guided = chat_request(chat(response_format={"type": "json_object"}), "r").params.guided
    assert guided == GuidedDecoding("json_schema", json.dumps({"type": "object"}), "response_format")
    guided = chat_request(chat(response_format=PERSON_FORMAT), "r").params.guided
    assert guided.kind == "json_schema" and json.loads(guided.spec) == PERSON


def test_completions_route_shares_the_translation():
    req = CompletionRequest.model_validate({"model": TINY_MODEL_ID, "prompt": "x", "response_format": PERSON_FORMAT})
    assert completion_request(req, "r").params.guided == chat_request(chat(response_format=PERSON_FORMAT), "r").params.guided


@pytest.mark.parametrize(
    "fmt, words",
    [
        ({"type": "xml"}, "does not match"),
        ({"type": "json_schema"}, "json_schema: Field required"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema: Field required"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "json_schema.schema"),
        ("json", "valid dictionary"),
    ],
)
def test_bad_shapes_name_response_format(fmt, words):
    with pytest.raises(Exception) as info:
        chat(response_format=fmt)
    err = validation_error(info.value)
    assert err.status == 400 and err.param == "response_format" and words in err.message


@pytest.mark.parametrize(
    "schema, words",
    [({"type": "objectx"}, "objectx"), ({"type": "string", "pattern": "a(b"}, "unclosed group")],
)
def test_schemas_llguidance_rejects_are_400(schema, words):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(APIError) as info:
        chat_request(chat(response_format=fmt), "r")
    assert info.value.status == 400 and info.value.param == "response_format" and words in info.value.message


def test_beam_search_with_response_format_is_refused():
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "response_format": {"type": "json_object"},
            "use_beam_search": True, "n": 2, "temperature": 0}
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, body)  # a rule of the dialect: refused at parse time
    assert info.value.param == "response_format"


# ------------------------------------------------------------ vLLM's structured_outputs


@pytest.mark.parametrize(("fields", "kind", "param"), [
    ({"structured_outputs": {"json": PERSON}}, "json_schema", "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(PERSON)}}, "json_schema", "structured_outputs.json"),
    ({"structured_outputs": {"json_object": True}}, "json_schema", "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": "[a-z]{3}"}}, "regex", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "lark", "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'start: "a" "b"*'}}, "lark", "structured_outputs.grammar"),
    ({"guided_json": PERSON}, "json_schema", "guided_json"),
    ({"guided_regex": "[0-9]+"}, "regex", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, "lark", "guided_choice"),
    ({"guided_grammar": 'start: "x"'}, "lark", "guided_grammar"),
])
def test_each_structured_output_field_becomes_guided_decoding(fields, kind, param):
    for guided in (chat_request(chat(**fields), "r").params.guided,
                   completion_request(CompletionRequest.model_validate({"model": TINY_MODEL_ID, "prompt": "p",
                                                                        **fields}), "r").params.guided):
        assert (guided.kind, guided.param) == (kind, param)
        if kind == "json_schema" and "json_object" not in param:
            assert json.loads(guided.spec) == PERSON


def test_a_choice_is_exactly_its_strings():
    guided = chat_request(chat(guided_choice=['say "hi"', "a\\b | c"]), "r").params.guided
    assert guided.spec == 'start: "say \\"hi\\"" | "a\\\\b | c"'


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice", "one structured output"),
    ({"guided_regex": "a", "guided_json": {"type": "object"}}, "guided_regex", "one structured output"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "cannot be combined"),
    ({"guided_regex": "(open"}, "guided_regex", "cannot be enforced"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "cannot be enforced"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not JSON"),
])
def test_broken_structured_outputs_are_400_naming_the_field(fields, param, words):
    with pytest.raises(APIError) as info:
        chat_request(chat(**fields), "r")
    assert info.value.status == 400 and info.value.param == param and words in info.value.message


def test_a_structured_output_with_forced_tool_calls_is_refused():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, {"model": TINY_MODEL_ID, "messages": MESSAGES, "tools": [tool],
                                              "tool_choice": "required", "guided_choice": ["a"]})
    assert info.value.param == "guided_choice"


# ------------------------------------------------------------------------ through Serve


@pytest.fixture(scope="module")
def client(tiny_app):
    return openai.OpenAI(base_url=tiny_app + "/v1", api_key="unused", max_retries=0)


def test_json_schema_content_validates(client):
    contents = []
    for seed in range(3):
        out = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, response_format=PERSON_FORMAT,
                                             temperature=1.0, seed=seed, max_tokens=96)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
        contents.append(out.choices[0].message.content)
    assert len(set(contents)) > 1


def test_json_object_content_parses_to_an_object(client):
    outs = [client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"}, max_tokens=128).choices[0]
            for seed in range(4)]
    stopped = [c.message.content for c in outs if c.finish_reason == "stop"]
    assert len(stopped) >= 3, [(c.finish_reason, c.message.content) for c in outs]
    assert all(isinstance(json.loads(text), dict) for text in stopped)


def test_streamed_json_schema_content_validates(client):
    stream = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, response_format=PERSON_FORMAT,
                                            temperature=1.0, seed=7, max_tokens=96, n=2, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_completions_route_honours_response_format(tiny_app):
    body = {"model": TINY_MODEL_ID, "prompt": "A person:", "response_format": PERSON_FORMAT, "max_tokens": 96,
            "seed": 1}
    resp = httpx.post(tiny_app + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), PERSON)


def test_invalid_schema_is_400_and_the_worker_keeps_serving(tiny_app):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 8}
    resp = httpx.post(tiny_app + "/v1/chat/completions", json={**body, "response_format": bad}, timeout=60)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "response_format" and "objectx" in error["message"]
    resp = httpx.post(tiny_app + "/v1/chat/completions", json={**body, "response_format": {"type": "bogus"}}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "response_format"
    resp = httpx.post(tiny_app + "/v1/chat/completions", json={**body, "response_format": PERSON_FORMAT,
                                                                "max_tokens": 96, "seed": 2}, timeout=60)
    assert resp.status_code == 200
    jsonschema.validate(json.loads(resp.json()["choices"][0]["message"]["content"]), PERSON)


def test_a_grammar_the_worker_cannot_compile_fails_that_request_only(tiny_app):
    """Grammars built inside the server (tool calling) skip the ingress check: the worker
    itself answers 400 and keeps serving."""
    from ray import serve

    from serve_app.app import worker_deployment_name
    from tests.support.serve_fixtures import worker_stats
    from workers.contract.requests import GenerateRequest
    from workers.contract.sampling_params import SamplingParams

    handle = serve.get_deployment_handle(worker_deployment_name(TINY_MODEL_ID), app_name="tiny").options(stream=True)
    steps_before = worker_stats("tiny", TINY_MODEL_ID).engine_steps
    bad = GenerateRequest(request_id="bad", messages=MESSAGES, max_tokens=8,
                          params=SamplingParams(guided=GuidedDecoding("lark", "start: undefined_rule")))
    chunks = [c for message in handle.generate.remote(bad) for c in message]
    assert len(chunks) == 1 and chunks[0].error.status == 400 and "undefined_rule" in chunks[0].error.message
    good = GenerateRequest(request_id="good", messages=MESSAGES, max_tokens=96,
                           params=SamplingParams(seed=4, guided=GuidedDecoding("json_schema", json.dumps(PERSON))))
    chunks = [c for message in handle.generate.remote(good) for c in message]
    assert chunks[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.text for c in chunks)), PERSON)
    assert worker_stats("tiny", TINY_MODEL_ID).engine_steps > steps_before


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("fields", "fits"), [
    ({"guided_choice": ["alpha", "beta gamma", "delta"]}, lambda text: text in ("alpha", "beta gamma", "delta")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
    ({"structured_outputs": {"json": PERSON}}, lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
    ({"guided_grammar": 'start: "(" ("ab" | "c")+ ")"'}, lambda text: re.fullmatch(r"\((ab|c)+\)", text)),
])
def test_each_structured_output_fits_its_constraint(tiny_app, fields, fits, stream):
    """Two sampled choices a request, streamed and not: each a whole fit (its grammar ended it)."""
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "n": 2, "temperature": 1.0, "seed": 7,
            "max_tokens": 96, "stream": stream, **fields}
    texts, finishes = {}, {}
    if stream:
        with httpx.stream("POST", tiny_app + "/v1/chat/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
                        finishes[choice["index"]] = choice.get("finish_reason") or finishes.get(choice["index"])
    else:
        resp = httpx.post(tiny_app + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        for choice in resp.json()["choices"]:
            texts[choice["index"]], finishes[choice["index"]] = choice["message"]["content"], choice["finish_reason"]
    assert finishes == {0: "stop", 1: "stop"}, (texts, finishes)
    assert all(fits(text) for text in texts.values()), texts


@pytest.mark.parametrize("stream", [False, True])
def test_the_responses_route_takes_structured_outputs(client, stream):
    """vLLM's fields on /v1/responses through the OpenAI SDK (`extra_body`), streamed and not."""
    options = ["alpha", "beta gamma", "delta"]
    kwargs = {"model": TINY_MODEL_ID, "input": "Pick one.", "temperature": 1.0, "max_output_tokens": 32,
              "store": False, "extra_body": {"seed": 3, "structured_outputs": {"choice": options}}}
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        response = next(e.response for e in events if e.type == "response.completed")
    else:
        response = client.responses.create(**kwargs)
    assert response.status == "completed" and response.output_text in options, response.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_structural_tag_holds_every_segment_it_opens(tiny_app, stream):
    """vLLM's structural tag with a trigger the random model writes often ("a"): each "a" must
    be followed by an integer and "!"; the text between is free (so the cap ends it)."""
    tag = {"type": "structural_tag", "triggers": ["a"],
           "structures": [{"begin": "a", "schema": {"type": "integer"}, "end": "!"}]}
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 64,
            "stream": stream, "response_format": tag}
    texts: dict[int, str] = {}
    if stream:
        with httpx.stream("POST", tiny_app + "/v1/chat/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    else:
        resp = httpx.post(tiny_app + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        texts = {c["index"]: c["message"]["content"] for c in resp.json()["choices"]}
    assert set(texts) == {0, 1} and sum(t.count("a") for t in texts.values()) > 0, texts
    for text in texts.values():
        segments = text.split("a")[1:]
        for i, segment in enumerate(segments):
            whole = re.match(r"-?(0|[1-9][0-9]*)!", segment)
            assert whole or (i == len(segments) - 1 and re.fullmatch(r"-?[0-9]*", segment)), (text, segment)
