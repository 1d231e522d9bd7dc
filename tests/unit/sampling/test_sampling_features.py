"""Engine-level behaviour of the per-request sampling fields: n, penalties, logit bias,
min_tokens, logprobs and prompt logprobs, checked against the model itself."""

from __future__ import annotations

import dataclasses

import torch

from tests.support.engines import make_engine, run_to_completion, tokens_by_choice
from workers.contract.sampling_params import SamplingParams


def prompt_ids(tokenizer, text="The quick brown fox jumps over the lazy dog. Paris is") -> list[int]:
    return tokenizer(text)["input_ids"]


def test_n_choices_share_one_prefill_and_differ(paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, num_blocks=64, block_size=4)
    prompt = prompt_ids(tiny_tokenizer)
    fed = []
    schedule = engine.scheduler.schedule

    def counting_schedule():
        batch = schedule()
        fed.append(batch.num_tokens)
        return batch

    engine.scheduler.schedule = counting_schedule
    params = SamplingParams(max_tokens=6, temperature=1.5, ignore_eos=True, n=3, seed=7)
    rid = engine.add_request(prompt, params)
    choices = tokens_by_choice(run_to_completion(engine)[rid])
    assert sorted(choices) == [0, 1, 2]
    assert all(len(t) == 6 for t in choices.values())
    assert len({tuple(t) for t in choices.values()}) == 3  # distinct samples
    # The prompt was fed once; then each choice fed its own 5 decode tokens.
    assert sum(fed) == len(prompt) + 3 * 5
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_forked_choices_keep_correct_cache(paged_model, tiny_tokenizer):
    """Greedy choices must all equal the single-choice greedy answer: copy-on-write keeps
    each choice's writes out of its siblings' shared blocks."""
    prompt = prompt_ids(tiny_tokenizer)  # length not a multiple of the block size
    assert len(prompt) % 4 != 0
    single = make_engine(paged_model, block_size=4)
    rid = single.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    expected = tokens_by_choice(run_to_completion(single)[rid])[0]
    engine = make_engine(paged_model, block_size=4)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=3))
    choices = tokens_by_choice(run_to_completion(engine)[rid])
    assert all(t == expected for t in choices.values())


def test_seeded_n_is_reproducible(paged_model, tiny_tokenizer):
    params = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True, n=2, seed=11)
    runs = []
    for _ in range(2):
        engine = make_engine(paged_model)
        rid = engine.add_request(prompt_ids(tiny_tokenizer), params)
        runs.append(tokens_by_choice(run_to_completion(engine)[rid]))
    assert runs[0] == runs[1]


def greedy_run(model, tokenizer, **params) -> list[int]:
    engine = make_engine(model)
    base = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(prompt_ids(tokenizer, "a"), dataclasses.replace(base, **params))
    return tokens_by_choice(run_to_completion(engine)[rid])[0]


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_penalties_lower_repetition(paged_model, tiny_tokenizer):
    plain = greedy_run(paged_model, tiny_tokenizer)
    assert repeats(plain) >= 10  # the random model loops without a penalty
    assert repeats(greedy_run(paged_model, tiny_tokenizer, frequency_penalty=2.0)) < repeats(plain)
    assert repeats(greedy_run(paged_model, tiny_tokenizer, presence_penalty=2.0)) < repeats(plain)
    assert repeats(greedy_run(paged_model, tiny_tokenizer, repetition_penalty=2.0)) < repeats(plain)


def test_logit_bias_forces_and_forbids(paged_model, tiny_tokenizer):
    forced = greedy_run(paged_model, tiny_tokenizer, logit_bias={42: 100.0})
    assert forced == [42] * 64
    plain = greedy_run(paged_model, tiny_tokenizer)
    banned = greedy_run(paged_model, tiny_tokenizer, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]


def test_min_tokens_holds_back_eos(paged_model, tiny_tokenizer):
    first = greedy_run(paged_model, tiny_tokenizer)[0]
    engine = make_engine(paged_model, eos=frozenset({first}))
    rid = engine.add_request(prompt_ids(tiny_tokenizer, "a"), SamplingParams(max_tokens=10, temperature=0.0))
    assert [e.token_id for e in run_to_completion(engine)[rid]] == [first]  # EOS at once
    engine = make_engine(paged_model, eos=frozenset({first}))
    rid = engine.add_request(prompt_ids(tiny_tokenizer, "a"), SamplingParams(max_tokens=10, temperature=0.0, min_tokens=4))
    events = run_to_completion(engine)[rid]
    assert len(events) >= 4
    assert first not in [e.token_id for e in events[:3]]


def test_logprobs_match_the_model(tiny_model, paged_model, tiny_tokenizer):
    prompt = prompt_ids(tiny_tokenizer)
    engine = make_engine(paged_model)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    rid = engine.add_request(prompt, params)
    events = run_to_completion(engine)[rid]
    output = [e.token_id for e in events]
    with torch.no_grad():
        logits = tiny_model(torch.tensor([prompt + output])).logits[0]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for step, event in enumerate(events):
        row = reference[len(prompt) - 1 + step]
        assert abs(event.logprob - float(row[event.token_id])) < 1e-4
        top_ids = [tid for tid, _ in event.top_logprobs]
        assert top_ids == row.topk(3).indices.tolist()
        assert top_ids[0] == event.token_id  # greedy picks the most likely token
    scored = events[0].prompt_logprobs
    assert [tid for tid, _, _ in scored] == prompt[1:]
    for position, (tid, logprob, top) in enumerate(scored):
        assert abs(logprob - float(reference[position][tid])) < 1e-4
        assert len(top) == 2
    assert all(e.prompt_logprobs is None for e in events[1:])


def sequence_logprob(model, prompt: list[int], output: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(output))


def test_beam_search_returns_top_beams_in_score_order(tiny_model, paged_model, tiny_tokenizer):
    prompt = prompt_ids(tiny_tokenizer)
    engine = make_engine(paged_model, num_blocks=128)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=3, use_beam_search=True, best_of=4)
    rid = engine.add_request(prompt, params)
    events = run_to_completion(engine)[rid]
    assert [e.index for e in events] == [0, 1, 2]
    assert events[-1].request_finished
    beams = [e.beam_token_ids for e in events]
    assert all(len(b) == 5 for b in beams) and len({tuple(b) for b in beams}) == 3
    scores = [e.logprob for e in events]
    assert scores == sorted(scores, reverse=True)
    for beam, score in zip(beams, scores):  # cumulative logprob is the model's own
        assert abs(sequence_logprob(tiny_model, prompt, beam) - score) < 1e-3
    # The best beam is at least as likely as the greedy answer.
    greedy = make_engine(paged_model)
    gid = greedy.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    greedy_tokens = [e.token_id for e in run_to_completion(greedy)[gid]]
    assert scores[0] >= sequence_logprob(tiny_model, prompt, greedy_tokens) - 1e-4
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_beam_search_finishes_on_eos(paged_model, tiny_tokenizer):
    prompt = prompt_ids(tiny_tokenizer)
    plain = make_engine(paged_model)
    rid = plain.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    second = [e.token_id for e in run_to_completion(plain)[rid]][1]
    engine = make_engine(paged_model, eos=frozenset({second}))
    params = SamplingParams(max_tokens=8, temperature=0.0, n=2, use_beam_search=True)
    rid = engine.add_request(prompt, params)
    events = run_to_completion(engine)[rid]
    assert len(events) == 2
    assert all(second not in e.beam_token_ids for e in events)  # EOS ends a beam, is not part of it
