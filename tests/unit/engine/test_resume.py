"""Resuming a request from output it already produced (workers/engine/resume.py), on the
tiny model: a fresh engine (another replica) given the first k tokens produces exactly
the rest of an uninterrupted run, for greedy, seeded, penalised, min_tokens, guided and
n > 1 requests; given ids that end the output finish at once; bad ones are refused."""

from __future__ import annotations

import json

import pytest

from tests.support.engines import make_engine, run_to_completion, template_ids
from workers.contract.sampling_params import GuidedDecoding, SamplingParams
from workers.core.sequence import FinishReason
from workers.engine.resume import ContinuationError

CUTS = (0, 1, 6, 13)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def prompt(tiny_tokenizer) -> list[int]:
    return template_ids(tiny_tokenizer, "Tell me about the fox.")


def by_choice(engine, request_id: int) -> dict[int, list]:
    out: dict[int, list] = {}
    for event in run_to_completion(engine)[request_id]:
        out.setdefault(event.index, []).append(event)
    return out


def uninterrupted(model, prompt, params, **engine_kw) -> dict[int, list]:
    engine = make_engine(model, **engine_kw)
    return by_choice(engine, engine.add_request(prompt, params))


def resumed(model, prompt, params, outputs: dict[int, list[int]], **engine_kw) -> dict[int, list]:
    """The request on a fresh engine (another replica), from the given output ids per choice."""
    engine = make_engine(model, **engine_kw)
    guide = engine.compile_guide(params)
    choices = engine.replay_output(prompt, params, outputs, guide)
    events = by_choice(engine, engine.add_request(prompt, params, resume=choices))
    assert engine.blocks.num_used_blocks == 0 and engine.num_active == 0
    return events


def tokens(events) -> list[int]:
    return [e.token_id for e in events]


PARAMS = {
    "greedy": SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=16, temperature=0.8, seed=11, ignore_eos=True),
    "seeded-top-p": SamplingParams(max_tokens=16, temperature=1.3, top_p=0.9, top_k=40, seed=2**40 + 3,
                                   ignore_eos=True),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_resumed_output_equals_the_uninterrupted_run(paged_model, prompt, name):
    params = PARAMS[name]
    reference = uninterrupted(paged_model, prompt, params)[0]
    for k in CUTS:
        rest = resumed(paged_model, prompt, params, {0: tokens(reference[:k])})[0]
        assert tokens(rest) == tokens(reference[k:]), k
        assert [e.finish_reason for e in rest] == [e.finish_reason for e in reference[k:]]


def test_penalties_and_min_tokens_count_the_given_ids(paged_model, prompt):
    """EOS is biased up so it comes as soon as min_tokens lets it: at output position 10.
    A resumed run that did not count the given ids would hold it off longer; one whose
    penalties did not see them would pick other tokens."""
    eos = frozenset({5})
    params = SamplingParams(max_tokens=24, temperature=0.7, seed=4, min_tokens=10, logit_bias={5: 8.0},
                            frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.3)
    reference = uninterrupted(paged_model, prompt, params, eos=eos)[0]
    assert len(reference) == 11 and reference[-1].finish_reason is FinishReason.STOP
    unpenalised = SamplingParams(max_tokens=24, temperature=0.7, seed=4, min_tokens=10, logit_bias={5: 8.0})
    assert tokens(reference) != tokens(uninterrupted(paged_model, prompt, unpenalised, eos=eos)[0])
    for k in (3, 9, 10):
        rest = resumed(paged_model, prompt, params, {0: tokens(reference[:k])}, eos=eos)[0]
        assert tokens(rest) == tokens(reference[k:]), k
        assert rest[-1].finish_reason is FinishReason.STOP


def test_guided_resume_advances_the_grammar(paged_model, tiny_tokenizer, prompt):
    guided = GuidedDecoding(kind="json_schema", spec=json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=9, guided=guided)
    kw = {"eos": frozenset({tiny_tokenizer.eos_token_id}), "tokenizer": tiny_tokenizer}
    reference = uninterrupted(paged_model, prompt, params, **kw)[0]
    assert reference[-1].finish_reason is FinishReason.STOP
    json.loads(tiny_tokenizer.decode(tokens(reference), skip_special_tokens=True))
    for k in (1, 4, len(reference) // 2, len(reference) - 1):
        rest = resumed(paged_model, prompt, params, {0: tokens(reference[:k])}, **kw)[0]
        assert tokens(rest) == tokens(reference[k:]), k
    engine = make_engine(paged_model, **kw)
    not_json = tiny_tokenizer("hello", add_special_tokens=False)["input_ids"]
    with pytest.raises(ContinuationError, match="rejects"):
        engine.replay_output(prompt, params, {0: not_json}, engine.compile_guide(params))


def test_n_choices_resume_each_from_its_own_output(paged_model, prompt):
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=21, n=3, ignore_eos=True)
    reference = uninterrupted(paged_model, prompt, params)
    assert len({tuple(tokens(reference[i])) for i in range(3)}) == 3
    # Choice 1 is finished (its client has it whole): it is not resumed.
    outputs = {0: tokens(reference[0][:5]), 2: tokens(reference[2][:0])}
    rest = resumed(paged_model, prompt, params, outputs)
    assert sorted(rest) == [0, 2]
    assert tokens(rest[0]) == tokens(reference[0][5:])
    assert tokens(rest[2]) == tokens(reference[2])
    assert rest[0][-1].request_finished != rest[2][-1].request_finished  # the later one ends the request


def test_first_new_token_reports_the_request_but_not_its_prompt_logprobs(paged_model, prompt):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2, n=2)
    reference = uninterrupted(paged_model, prompt, params)
    assert reference[0][0].prompt_logprobs
    outputs = {0: tokens(reference[0][:5]), 1: tokens(reference[1][:2])}
    engine = make_engine(paged_model)  # blocks of 4: the prefix cache reaches into choice 0's output
    engine.add_request(prompt + outputs[0], SamplingParams(max_tokens=1))
    run_to_completion(engine)
    events = by_choice(engine, engine.add_request(prompt, params, resume=engine.replay_output(
        prompt, params, outputs, None)))
    assert tokens(events[0]) == tokens(reference[0][5:]) and tokens(events[1]) == tokens(reference[1][2:])
    firsts = [e for choice in events.values() for e in choice if e.queue_time is not None]
    assert [e.index for e in firsts] == [0]  # once per request, on the leading choice
    assert firsts[0].cached_tokens == len(prompt)  # prompt tokens only, not the given output found too
    assert all(e.prompt_logprobs is None for choice in events.values() for e in choice)


def test_given_ids_that_end_the_output_finish_at_once(paged_model, prompt):
    engine = make_engine(paged_model, eos=frozenset({7}))
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    [eos] = engine.replay_output(prompt, greedy, {0: [30, 31, 7]}, None)
    assert (eos.finish_reason, eos.stop_token_id) == (FinishReason.STOP, None)
    [length] = engine.replay_output(prompt, greedy, {0: [30, 31, 32, 33, 34]}, None)
    assert length.finish_reason is FinishReason.LENGTH
    stop = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(40,))
    [stopped] = engine.replay_output(prompt, stop, {0: [30, 40]}, None)
    assert (stopped.finish_reason, stopped.stop_token_id) == (FinishReason.STOP, 40)
    [ignored] = engine.replay_output(prompt, SamplingParams(max_tokens=5, ignore_eos=True), {0: [7, 7]}, None)
    assert ignored.finish_reason is None and ignored.output_ids == [7, 7]
    with pytest.raises(ValueError):
        engine.add_request(prompt, greedy, resume=[eos])  # a finished choice is not resumed


@pytest.mark.parametrize("outputs, message", [
    ({0: [30, 7, 31]}, "after the output ended"),
    ({0: [30, 31, 32, 33, 34, 35]}, "after the output ended"),
    ({0: [30, 10_000]}, "outside the vocabulary"),
    ({0: [-1]}, "outside the vocabulary"),
])
def test_continuations_that_cannot_be_are_refused(paged_model, prompt, outputs, message):
    engine = make_engine(paged_model, eos=frozenset({7}))
    with pytest.raises(ContinuationError, match=message):
        engine.replay_output(prompt, SamplingParams(max_tokens=5, temperature=0.0), outputs, None)


def test_beam_search_is_not_resumed_from_partial_output(paged_model, prompt):
    engine = make_engine(paged_model)
    beams = SamplingParams(max_tokens=5, temperature=0.0, use_beam_search=True, n=2)
    with pytest.raises(ContinuationError, match="from the start"):
        engine.replay_output(prompt, beams, {0: [30]}, None)
