"""A thinking budget (vLLM's thinking_token_budget, Anthropic's thinking.budget_tokens):
the reasoning section's tokens counted from its start tag, its end tag forced once the
budget is spent, nothing changed before that or outside the section."""

from __future__ import annotations

from tests.support.engines import make_engine, run_to_completion
from workers.contract.sampling_params import SamplingParams, ThinkingBudget
from workers.core.thinking import COUNTING, DONE, FORCING, WAITING, ThinkingState

START, END = (50,), (60, 61)  # a one-token start tag, a two-token end tag


def budget(tokens: int) -> ThinkingBudget:
    return ThinkingBudget(tokens, "<think>", "</think>", start_ids=START, end_ids=END)


def test_the_section_is_counted_from_its_start_and_its_end_forced():
    state = ThinkingState(budget(3), [1, 2], [])
    assert state.stage == WAITING and state.forced_token() is None
    for token in (7, 50, 8, 9):
        state.push(token)
    assert (state.stage, state.forced_token()) == (COUNTING, None)
    state.push(10)  # the third token inside
    assert (state.stage, state.forced_token()) == (FORCING, 60)
    state.push(60)
    assert state.forced_token() == 61
    state.push(61)
    assert (state.stage, state.forced_token()) == (DONE, None)
    state.push(50)  # a later start tag opens nothing
    assert state.stage == DONE


def test_free_run_counts_the_proposals_no_forced_token_follows():
    """Speculation's cut: of proposed tokens, the leading ones after each of which the next
    token is still free; the state itself does not move."""
    state = ThinkingState(budget(3), [1, 50], [8])  # one token counted, two left
    assert state.free_run((9, 10, 11)) == 1  # after 9 one is left; after 10 the end is forced
    assert ThinkingState(budget(5), [1, 50], [8]).free_run((9, 60, 61, 12)) == 4  # the model's own end tag
    assert state.free_run((7, 50)) == 1
    assert (state.stage, state.count) == (COUNTING, 1)
    waiting = ThinkingState(budget(1), [1], [])
    assert waiting.free_run((4, 50, 5, 6)) == 2  # opened by the second, forced after its first token


def test_a_natural_end_stops_the_count_and_a_prompt_may_leave_the_section_open():
    state = ThinkingState(budget(5), [1, 50], [3, 60, 61])  # open in the prompt, closed by the model
    assert (state.stage, state.forced_token()) == (DONE, None)
    closed = ThinkingState(budget(5), [50, 4, 60, 61, 2], [])  # a template's closed, empty section
    assert closed.stage == WAITING
    replayed = ThinkingState(budget(2), [1, 50], [4, 5, 60])  # rebuilt mid-forcing from the tokens alone
    assert (replayed.stage, replayed.forced_token()) == (FORCING, 61)


def _outputs(engine, prompt, params) -> list[list[int]]:
    request = engine.add_request(prompt, params)
    by_choice: dict[int, list[int]] = {}
    for event in run_to_completion(engine)[request]:
        by_choice.setdefault(event.index, []).append(event.token_id)
    return [by_choice[i] for i in sorted(by_choice)]


def _greedy(**fields) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **fields)


def test_the_engine_forces_the_end_tag_once_the_budget_is_spent(paged_model):
    """A prompt that opens the section: the first 4 tokens are the free run's, then the end tag."""
    engine = make_engine(paged_model)
    prompt = [3, 9, 14, 50]
    free = _outputs(engine, prompt, _greedy())[0]
    assert 60 not in free[:6]
    got = _outputs(engine, prompt, _greedy(thinking_budget=budget(4)))[0]
    assert got[:4] == free[:4] and got[4:6] == list(END)


def test_a_section_the_output_opens_is_counted_from_its_start_tag(paged_model):
    """The start tag made every token by logit_bias: the first opens the section, four more
    are counted, the end tag is forced over the bias, then the bias has its way again."""
    engine = make_engine(paged_model)
    got = _outputs(engine, [3, 9, 14], _greedy(thinking_budget=budget(4), logit_bias={50: 100.0}))[0]
    assert got == [50] * 5 + list(END) + [50] * 3


def test_a_section_never_opened_is_left_alone(paged_model):
    engine = make_engine(paged_model)
    free = _outputs(engine, [3, 9, 14], _greedy())[0]
    assert 50 not in free
    assert _outputs(engine, [3, 9, 14], _greedy(thinking_budget=budget(2)))[0] == free


def test_each_choice_counts_its_own_section(paged_model):
    """n=2 sampled choices, forked after the prompt: each forces the end tag after its own
    third token."""
    engine = make_engine(paged_model)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=2, ignore_eos=True, thinking_budget=budget(3))
    choices = _outputs(engine, [3, 9, 14, 50], params)
    assert len(choices) == 2 and choices[0] != choices[1]
    for tokens in choices:
        assert 60 not in tokens[:3] and tokens[3:5] == list(END)


def test_the_worker_tokenizes_the_tags_and_the_output_closes_the_section(paged_model, tiny_tokenizer):
    """Through the request processor: an assistant turn continued after `<think>` (the
    section open in the prompt), a budget of 3 tokens: the text after them is `</think>`."""
    import asyncio
    import dataclasses

    from tests.support.engines import chat_request, generate, with_async_engine
    from workers.serving.request_processor import RequestProcessor

    request = chat_request("Why?", 12, ignore_eos=True)
    request = dataclasses.replace(
        request, messages=[*request.messages, {"role": "assistant", "content": "<think>"}],
        add_generation_prompt=False, continue_final_message=True,
        params=dataclasses.replace(request.params, thinking_budget=ThinkingBudget(3, "<think>", "</think>")))
    end_ids = tiny_tokenizer.encode("</think>", add_special_tokens=False)

    async def body(aengine):
        return [c async for c in generate(RequestProcessor(aengine, tiny_tokenizer), request)]

    chunks = asyncio.run(with_async_engine(make_engine(paged_model), body))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens[3:3 + len(end_ids)] == end_ids
    assert "</think>" in "".join(c.text for c in chunks)
