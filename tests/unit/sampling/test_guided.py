"""Constrained decoding in the engine (workers/sampling/guided.py) on the tiny random model.

The model's weights are random, so whatever it picks is noise: every output below is
valid only because the grammar mask made it so.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from tests.support.engines import (
    generate,
    make_engine,
    record_preemptions,
    run_to_completion,
    template_ids,
    tokens_by_choice,
    with_async_engine,
)
from tests.support.tiny_models import build_tiny_llama
from workers.contract.grammar import GuidedDecodingError, grammar_error, lark_json
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import GuidedDecoding, SamplingParams
from workers.core.sequence import FinishReason
from workers.engine.llm_engine import LLMEngine
from workers.sampling.guided import GuideState
from workers.serving.request_processor import RequestProcessor

SCHEMAS = {
    "nested-objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 5}, "zip": {"type": "integer"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "flag": {"enum": [True, None, 3]},
        },
        "required": ["color", "size", "flag"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
                    "maxItems": 4},
            "pairs": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                      "maxItems": 2},
        },
        "required": ["ids", "pairs"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 3, "maximum": 17},
            "ratio": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "neg": {"type": "integer", "exclusiveMaximum": 0, "minimum": -50},
        },
        "required": ["count", "ratio", "neg"],
        "additionalProperties": False,
    },
    "required-and-optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9},
            "note": {"type": "string", "maxLength": 4},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
}

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TOOL_LARK = f'start: "<tool_call>" call "</tool_call>"\ncall: {lark_json(TOOL_SCHEMA)}\n'


def schema_guide(schema: dict) -> GuidedDecoding:
    return GuidedDecoding(kind="json_schema", spec=json.dumps(schema))


def sampled(guided: GuidedDecoding, seed: int, max_tokens: int = 128, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, guided=guided, **kw)


def guided_engine(model, tokenizer, **kw) -> LLMEngine:
    return make_engine(model, eos=frozenset({tokenizer.eos_token_id}), tokenizer=tokenizer, **kw)


@pytest.fixture
def engine(paged_model, tiny_tokenizer) -> LLMEngine:
    return guided_engine(paged_model, tiny_tokenizer)


@pytest.fixture(scope="module")
def prompt(tiny_tokenizer) -> list[int]:
    return template_ids(tiny_tokenizer, "Reply in JSON, please.")


def texts(engine: LLMEngine, tokenizer, requests: list[int]) -> tuple[list[str], list[FinishReason]]:
    events = run_to_completion(engine)
    outs = [tokenizer.decode([e.token_id for e in events[r]], skip_special_tokens=True) for r in requests]
    return outs, [events[r][-1].finish_reason for r in requests]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_outputs_validate_against_the_schema(engine, tiny_tokenizer, prompt, name):
    schema = SCHEMAS[name]
    ids = [engine.add_request(prompt, sampled(schema_guide(schema), seed)) for seed in range(6)]
    outs, reasons = texts(engine, tiny_tokenizer, ids)
    assert reasons == [FinishReason.STOP] * len(ids), outs
    for out in outs:
        jsonschema.validate(json.loads(out), schema)
    assert len(set(outs)) > 1  # sampled, not a fixed answer
    assert engine.blocks.num_used_blocks == 0


def test_unconstrained_rows_of_the_same_sampler_would_not_validate(paged_model, tiny_tokenizer, prompt):
    """The control: without the mask the tiny model's output is not JSON at all."""
    engine = make_engine(paged_model, eos=frozenset({tiny_tokenizer.eos_token_id}))
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=s)) for s in range(4)]
    outs, _ = texts(engine, tiny_tokenizer, ids)
    for out in outs:
        with pytest.raises(ValueError):
            json.loads(out)


def test_json_object_always_parses_to_an_object(engine, tiny_tokenizer, prompt):
    guided = GuidedDecoding(kind="json_schema", spec='{"type": "object"}')
    ids = [engine.add_request(prompt, sampled(guided, seed, max_tokens=64)) for seed in range(8)]
    outs, reasons = texts(engine, tiny_tokenizer, ids)
    finished = [out for out, reason in zip(outs, reasons) if reason is FinishReason.STOP]
    assert len(finished) >= 6, list(zip(outs, reasons))  # free-form objects may run out of tokens
    for out in finished:
        assert isinstance(json.loads(out), dict)
    for out, reason in zip(outs, reasons):
        if reason is FinishReason.LENGTH:
            assert out.startswith("{")  # a cut-off object, still on the grammar's path


def test_n_choices_each_get_their_own_grammar_state(engine, tiny_tokenizer, prompt):
    schema = SCHEMAS["required-and-optional"]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=3, n=4,
                                                    guided=schema_guide(schema)))
    by_choice = tokens_by_choice(run_to_completion(engine)[rid])
    outs = [tiny_tokenizer.decode(by_choice[i], skip_special_tokens=True) for i in range(4)]
    for out in outs:
        jsonschema.validate(json.loads(out), schema)
    assert len(set(outs)) > 1


def test_unconstrained_neighbour_is_untouched(paged_model, tiny_tokenizer, prompt):
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = guided_engine(paged_model, tiny_tokenizer)
    alone_id = alone.add_request(prompt, plain)
    expected = [e.token_id for e in run_to_completion(alone)[alone_id]]

    mixed = guided_engine(paged_model, tiny_tokenizer)
    guided_ids = [mixed.add_request(prompt, sampled(schema_guide(SCHEMAS["enums"]), s)) for s in range(3)]
    plain_id = mixed.add_request(prompt, plain)
    events = run_to_completion(mixed)
    assert [e.token_id for e in events[plain_id]] == expected
    for rid in guided_ids:
        json.loads(tiny_tokenizer.decode([e.token_id for e in events[rid]], skip_special_tokens=True))


def test_lark_grammar_with_embedded_json_schema(engine, tiny_tokenizer, prompt):
    """The shape tool calling uses: literal text around a `%json` schema."""
    guided = GuidedDecoding(kind="lark", spec=TOOL_LARK)
    assert grammar_error(guided) is None
    ids = [engine.add_request(prompt, sampled(guided, seed)) for seed in range(4)]
    outs, reasons = texts(engine, tiny_tokenizer, ids)
    assert reasons == [FinishReason.STOP] * 4, outs
    schema = TOOL_SCHEMA
    for out in outs:
        match = re.fullmatch(r"<tool_call>(.*)</tool_call>", out, re.S)
        assert match, out
        jsonschema.validate(json.loads(match.group(1)), schema)


def test_complete_grammar_ends_the_sequence_even_with_ignore_eos_and_min_tokens(engine, tiny_tokenizer, prompt):
    guided = GuidedDecoding(kind="regex", spec=r"(yes|no)-[0-9]{2}")
    params = sampled(guided, 1, max_tokens=40, ignore_eos=True, min_tokens=30)
    rid = engine.add_request(prompt, params)
    events = run_to_completion(engine)[rid]
    text = tiny_tokenizer.decode([e.token_id for e in events], skip_special_tokens=True)
    assert re.fullmatch(r"(yes|no)-[0-9]{2}", text), text
    assert events[-1].finish_reason is FinishReason.STOP and len(events) < 30


def test_mask_beats_logit_bias_and_penalties(engine, tiny_tokenizer, prompt):
    x = tiny_tokenizer.convert_tokens_to_ids("x")
    guided = GuidedDecoding(kind="regex", spec=r"[ab]{3,6}")
    params = sampled(guided, 2, logit_bias={x: 100.0}, presence_penalty=2.0, repetition_penalty=1.9)
    rid = engine.add_request(prompt, params)
    events = run_to_completion(engine)[rid]
    text = tiny_tokenizer.decode([e.token_id for e in events], skip_special_tokens=True)
    assert re.fullmatch(r"[ab]{3,6}", text), text


def test_logprobs_report_the_models_own_distribution(engine, tiny_tokenizer, prompt):
    plain = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    guided = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, logprobs=5,
                                                       guided=GuidedDecoding("regex", "[0-9]+")))
    events = run_to_completion(engine)
    first_plain, first_guided = events[plain][0], events[guided][0]
    assert [t for t, _ in first_guided.top_logprobs] == [t for t, _ in first_plain.top_logprobs]
    assert [lp for _, lp in first_guided.top_logprobs] == pytest.approx([lp for _, lp in first_plain.top_logprobs])
    assert first_guided.token_id != first_plain.token_id  # the mask chose a digit instead
    assert tiny_tokenizer.decode([first_guided.token_id]).isdigit()


def test_logits_wider_than_the_tokenizer_are_masked(tiny_tokenizer, paged_attn_name, prompt):
    wide = len(tiny_tokenizer) + 37
    model = build_tiny_llama(wide, seed=1)
    model.set_attn_implementation(paged_attn_name)
    engine = guided_engine(model, tiny_tokenizer)
    assert engine.vocab_size == wide
    ghost = wide - 3  # an id the tokenizer does not have, pushed to the top
    ids = [engine.add_request(prompt, sampled(schema_guide(SCHEMAS["enums"]), s, logit_bias={ghost: 100.0}))
           for s in range(3)]
    events = run_to_completion(engine)
    for rid in ids:
        tokens = [e.token_id for e in events[rid]]
        assert all(t < len(tiny_tokenizer) for t in tokens)
        jsonschema.validate(json.loads(tiny_tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMAS["enums"])


def test_preemption_keeps_the_grammar_state(paged_model, tiny_tokenizer, prompt):
    def run(num_blocks: int) -> tuple[list[list[int]], int]:
        engine = guided_engine(paged_model, tiny_tokenizer, num_blocks=num_blocks, max_num_batched_tokens=16)
        preempted = record_preemptions(engine)
        ids = [engine.add_request(prompt, sampled(schema_guide(SCHEMAS["numbers"]), s, max_tokens=64))
               for s in range(4)]
        events = run_to_completion(engine)
        return [[e.token_id for e in events[r]] for r in ids], len(preempted)

    roomy, _ = run(256)
    tight, preemptions = run(-(-(len(prompt) + 64) // 4) + 1)
    assert preemptions > 0
    assert tight == roomy
    for tokens in tight:
        jsonschema.validate(json.loads(tiny_tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMAS["numbers"])


def test_a_failed_step_rolls_the_matchers_back(paged_model, tiny_tokenizer, prompt):
    """The failure strikes after the guided tokens were fed to their matchers: the undo
    must roll them back, or the re-run step would feed a second token on top."""
    guides = [schema_guide(SCHEMAS["nested-objects"]), GuidedDecoding("lark", TOOL_LARK)]
    # Greedy: a retried step draws no new random numbers, so the outputs must match exactly.
    params = [SamplingParams(max_tokens=96, temperature=0.0, guided=g) for g in guides]
    clean = guided_engine(paged_model, tiny_tokenizer)
    clean_ids = [clean.add_request(prompt, p) for p in params]
    expected = run_to_completion(clean)

    engine = guided_engine(paged_model, tiny_tokenizer)
    good = [engine.add_request(prompt, p) for p in params]
    early = [ev for _ in range(4) for ev in engine.step()]  # into the middle of the JSON
    bad = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    append = engine.scheduler.append_tokens

    def poisoned_append(seqs, tokens):
        results = append(seqs, tokens)
        if any(s.request_id == bad for s in seqs):
            raise RuntimeError("injected failure after the tokens were appended")
        return results

    engine.scheduler.append_tokens = poisoned_append
    events = run_to_completion(engine)
    assert [e.error is not None for e in events[bad]] == [True]
    for rid, ref in zip(good, clean_ids):
        tokens = [e.token_id for e in early if e.request_id == rid] + [e.token_id for e in events[rid]]
        assert tokens == [e.token_id for e in expected[ref]]
        assert events[rid][-1].finish_reason is FinishReason.STOP


def test_guide_truncate_restores_the_mask(engine, tiny_tokenizer):
    guide = engine.compile_guide(sampled(schema_guide(SCHEMAS["enums"]), 0))
    before = engine.guided.mask([guide], engine.device).forbidden.clone()
    tokens = tiny_tokenizer.encode('{"color":"re', add_special_tokens=False)
    for t in tokens:
        assert not guide.advance(t)
    assert not torch.equal(engine.guided.mask([guide], engine.device).forbidden, before)
    guide.truncate([])
    assert torch.equal(engine.guided.mask([guide], engine.device).forbidden, before)
    with pytest.raises(GuidedDecodingError):
        guide.advance(tiny_tokenizer.convert_tokens_to_ids("}"))


def test_invalid_grammar_fails_that_request_only(engine, prompt):
    bad = GuidedDecoding("json_schema", json.dumps({"type": "objectx"}))
    assert "objectx" in grammar_error(bad)
    assert grammar_error(GuidedDecoding("lark", "start: nothing_here")) is not None
    assert grammar_error(GuidedDecoding("json_schema", "[1")) is not None
    with pytest.raises(GuidedDecodingError, match="objectx"):
        engine.add_request(prompt, sampled(bad, 0))
    with pytest.raises(GuidedDecodingError, match="beam search"):
        engine.add_request(prompt, SamplingParams(n=2, use_beam_search=True, temperature=0.0,
                                                  guided=schema_guide(SCHEMAS["enums"])))
    rid = engine.add_request(prompt, sampled(schema_guide(SCHEMAS["enums"]), 0))
    assert run_to_completion(engine)[rid][-1].finish_reason is FinishReason.STOP


def test_an_engine_without_tokenizer_refuses_guided_requests(paged_model, prompt):
    engine = make_engine(paged_model)
    with pytest.raises(GuidedDecodingError, match="tokenizer"):
        engine.add_request(prompt, sampled(schema_guide(SCHEMAS["enums"]), 0))


def test_request_processor_reports_a_bad_grammar_as_400(paged_model, tiny_tokenizer):
    engine = guided_engine(paged_model, tiny_tokenizer, max_model_len=256)

    def request(spec: str) -> GenerateRequest:
        return GenerateRequest(request_id="r", params=SamplingParams(temperature=1.0, seed=0,
                                                                     guided=GuidedDecoding("json_schema", spec,
                                                                                           param="response_format")),
                               messages=[{"role": "user", "content": "JSON"}], max_tokens=64)

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        bad = [c async for c in generate(processor, request('{"type": "objectx"}'))]
        good = [c async for c in generate(processor, request(json.dumps(SCHEMAS["enums"])))]
        return bad, good

    bad, good = asyncio.run(with_async_engine(engine, body))
    assert len(bad) == 1 and bad[0].error.status == 400 and "objectx" in bad[0].error.message
    assert bad[0].error.param == "response_format" and bad[0].error.code == "invalid_grammar"
    assert good[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.text for c in good)), SCHEMAS["enums"])


def test_a_grammar_that_admits_nothing_is_refused_at_admission(engine, prompt):
    self_only = GuidedDecoding("json_schema", json.dumps({"$ref": "#"}))
    assert grammar_error(self_only) is None  # valid to llguidance without a tokenizer ...
    with pytest.raises(GuidedDecodingError, match="admits no output"):  # ... empty with one
        engine.add_request(prompt, sampled(self_only, 0))


def test_a_dead_end_mid_output_is_a_400_for_that_request_only(paged_model, tiny_tokenizer):
    """A tool call whose arguments admit nothing: the call's opening is allowed, then no
    token can follow. That request gets a 400 naming its field; its neighbour finishes."""
    engine = guided_engine(paged_model, tiny_tokenizer, max_model_len=256)
    dead_end = GuidedDecoding("lark", f'start: "<tool_call>" {lark_json({"$ref": "#"})}', param="tools")

    def request(rid: str, guided: GuidedDecoding | None) -> GenerateRequest:
        return GenerateRequest(request_id=rid, params=SamplingParams(temperature=0.0, guided=guided),
                               messages=[{"role": "user", "content": "Call it"}], max_tokens=32)

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)

        async def collect(req):
            return [c async for c in generate(processor, req)]
        return await asyncio.gather(collect(request("bad", dead_end)), collect(request("good", None)))

    bad, good = asyncio.run(with_async_engine(engine, body))
    assert bad[-1].error.status == 400 and bad[-1].error.code == "invalid_grammar", bad[-1]
    assert "\n" not in bad[-1].error.message  # llguidance's parser dump is left out
    assert good[-1].finish_reason == "length" and good[-1].error is None


def test_speculation_under_a_grammar_keeps_the_tokens_and_takes_proposals(paged_model, tiny_tokenizer, prompt):
    """Method suffix on guided requests: the second wave replays the first's grammar-valid
    answers, so its proposals are taken; each verification row is masked by the grammar
    after the proposals before it, so greedy and seeded outputs equal the plain engine's."""
    from workers.core.limits import SpeculativeLimits

    suffix = SpeculativeLimits(num_tokens=6, lookup_min=1, lookup_max=3, disable_by_batch_size=None,
                               method="suffix", history_requests=64)
    requests = [SamplingParams(max_tokens=40, temperature=0.0, guided=schema_guide(SCHEMAS[name]))
                for name in SCHEMAS] + [sampled(schema_guide(SCHEMAS["enums"]), seed, max_tokens=40)
                                        for seed in range(2)]

    def outputs(engine, waves: int) -> list[list[int]]:
        out = []
        for _ in range(waves):
            for params in requests:  # one at a time: each is the only sequence running
                rid = engine.add_request(prompt, params)
                out.append([e.token_id for e in run_to_completion(engine)[rid]])
        return out

    plain = outputs(guided_engine(paged_model, tiny_tokenizer), 1)
    engine = guided_engine(paged_model, tiny_tokenizer, speculative=suffix)
    assert outputs(engine, 2) == plain + plain
    counts = engine.proposer.counts
    assert counts.accepted_tokens > sum(len(tokens) for tokens in plain) // 2
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_proposals_are_cut_where_the_grammar_refuses(engine, tiny_tokenizer):
    guide = engine.guided.compile(GuidedDecoding(kind="regex", spec="ab+c"))
    a, b, c = (tiny_tokenizer.convert_tokens_to_ids(t) for t in "abc")
    assert guide.allowed_prefix((a, b, b, c)) == (a, b, b, c)
    assert guide.allowed_prefix((a, b, a, c)) == (a, b)
    assert guide.allowed_prefix((b, a)) == ()
    assert guide.allowed_prefix((a, b, c, tiny_tokenizer.eos_token_id)) == (a, b, c)
    assert guide.allowed_prefix(()) == ()
    assert guide.num_tokens == 0  # nothing consumed


def test_prompt_lookup_proposals_outside_the_grammar_are_cut_not_fed(paged_model, tiny_tokenizer):
    """Method ngram copies from a prompt full of near-JSON: many proposals leave the schema
    part way. Only the part the grammar takes is fed (a row after a refused token would
    have nothing to sample from), and sampled outputs equal the plain engine's."""
    from workers.core.limits import SpeculativeLimits

    ngram = SpeculativeLimits(num_tokens=6, lookup_min=1, lookup_max=3, disable_by_batch_size=None)
    text = 'Records: {"name": "ab", "age": x1} {"name": "cd", "age": "2"} {"nam": 3, "age": [4]} ' * 3
    prompt = template_ids(tiny_tokenizer, text + "Reply with one record in JSON.")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    requests = [sampled(schema_guide(schema), seed, max_tokens=40) for seed in range(6)]

    def outputs(engine) -> list[list[int]]:
        out = []
        for params in requests:
            rid = engine.add_request(prompt, params)
            out.append([e.token_id for e in run_to_completion(engine)[rid]])
        return out

    plain = outputs(guided_engine(paged_model, tiny_tokenizer))
    engine = guided_engine(paged_model, tiny_tokenizer, speculative=ngram)
    cut = []
    allowed = GuideState.allowed_prefix

    def spy(guide, tokens):
        kept = allowed(guide, tokens)
        cut.append(len(tokens) - len(kept))
        return kept

    GuideState.allowed_prefix = spy
    try:
        assert outputs(engine) == plain
    finally:
        GuideState.allowed_prefix = allowed
    assert sum(cut) > 0 and engine.proposer.counts.draft_tokens > 0
