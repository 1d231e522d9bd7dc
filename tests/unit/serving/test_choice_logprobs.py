"""Logprobs travel with their text (workers/serving/choice_output.py): every generated token
has one entry, as usage counts it (vLLM's rule), the hidden EOS or stop token and tokens cut
off with a stop string included (they go out at the end); a stream's entries arrive with the
text of their tokens, also when a possible stop string or a partial character holds it."""

from __future__ import annotations

import pytest

from workers.contract.sampling_params import SamplingParams
from workers.core.events import TokenEvent
from workers.core.sequence import FinishReason
from workers.serving.choice_output import ChoiceOutput, Usage

EOS = -1  # replaced by the tokenizer's


def events_of(tokenizer, text: str, finish: FinishReason, stop_token: int | None = None) -> list[TokenEvent]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if finish is FinishReason.STOP:
        ids = ids + [tokenizer.eos_token_id if stop_token is None else stop_token]
    events = [TokenEvent(0, 0, t, None, None, 1.0 + i, logprob=-0.5 - i / 100, top_logprobs=[])
              for i, t in enumerate(ids)]
    last = events[-1]
    events[-1] = TokenEvent(0, 0, last.token_id, finish, stop_token, last.time, last.logprob, [])
    return events


def run(tokenizer, events: list[TokenEvent], per_chunk: int, **params) -> list[tuple[str, list[str]]]:
    """(text, logprob tokens) of each chunk, `per_chunk` events a chunk; every token the
    usage counts has one entry."""
    output = ChoiceOutput(tokenizer, [1, 2], SamplingParams(logprobs=0, **params), arrival=0.0)
    usage, chunks = Usage(prompt_tokens=2), []
    for i in range(0, len(events), per_chunk):
        chunk = output.chunk(0, events[i:i + per_chunk], usage)
        chunks.append((chunk.text, [t.token for t in chunk.logprobs]))
        if chunk.finish_reason is not None:
            break
    assert sum(len(toks) for _, toks in chunks) == usage.completion_tokens
    return chunks


@pytest.mark.parametrize("per_chunk", [1, 2, 100])
def test_the_hidden_eos_token_has_the_last_entry(tiny_tokenizer, per_chunk):
    chunks = run(tiny_tokenizer, events_of(tiny_tokenizer, "Hello there world", FinishReason.STOP), per_chunk)
    assert "".join(t for t, _ in chunks) == "Hello there world"
    eos = tiny_tokenizer.decode([tiny_tokenizer.eos_token_id])
    assert "".join(tok for _, toks in chunks for tok in toks) == "Hello there world" + eos
    assert chunks[-1][1][-1] == eos


def test_a_length_finish_keeps_its_last_token(tiny_tokenizer):
    chunks = run(tiny_tokenizer, events_of(tiny_tokenizer, "Hello there world", FinishReason.LENGTH), 1)
    assert "".join(tok for _, toks in chunks for tok in toks) == "Hello there world"


@pytest.mark.parametrize("include", [False, True])
def test_tokens_cut_off_with_a_stop_string_keep_their_entries(tiny_tokenizer, include):
    events = events_of(tiny_tokenizer, "one two three END four five", FinishReason.LENGTH)
    chunks = run(tiny_tokenizer, events, 1, stop=(" END",), include_stop_str_in_output=include)
    text = "".join(t for t, _ in chunks)
    assert text == ("one two three END" if include else "one two three")
    assert "".join(tok for _, toks in chunks for tok in toks) == "one two three END"  # the generated tokens
    sent_text = sent_tokens = ""
    for chunk_text, toks in chunks[:-1]:  # before the end, an entry never goes out before its token's text
        sent_text, sent_tokens = sent_text + chunk_text, sent_tokens + "".join(toks)
        assert sent_text.startswith(sent_tokens), chunks


def test_a_shown_stop_token_keeps_its_entry(tiny_tokenizer):
    stop = tiny_tokenizer(" stop", add_special_tokens=False)["input_ids"][-1]
    events = events_of(tiny_tokenizer, "go", FinishReason.STOP, stop_token=stop)
    chunks = run(tiny_tokenizer, events, 1, stop_token_ids=(stop,), include_stop_str_in_output=True)
    assert [tok for _, toks in chunks for tok in toks][-1] == tiny_tokenizer.decode([stop])
    hidden = run(tiny_tokenizer, events, 1, stop_token_ids=(stop,))
    assert "".join(t for t, _ in hidden) == "go"
    assert [tok for _, toks in hidden for tok in toks][-1] == tiny_tokenizer.decode([stop])  # hidden, counted


def test_a_partial_character_waits_with_its_entries(tiny_tokenizer):
    text = "a \U0001f600 b"  # an emoji: several byte tokens, text only once all are in
    events = events_of(tiny_tokenizer, text, FinishReason.STOP)
    chunks = run(tiny_tokenizer, events, 1)
    assert "".join(t for t, _ in chunks) == text
    assert any("\ufffd" in tiny_tokenizer.decode([e.token_id]) for e in events)  # the emoji is split
    for chunk_text, toks in chunks[:-1]:
        assert bool(chunk_text) == bool(toks), chunks  # entries only beside text
    assert chunks[-1] == ("", [tiny_tokenizer.decode([tiny_tokenizer.eos_token_id])])  # the hidden EOS's


def test_a_character_the_output_never_finishes_keeps_its_entries(tiny_tokenizer):
    ids = tiny_tokenizer("a \U0001f600", add_special_tokens=False)["input_ids"]
    events = [TokenEvent(0, 0, t, None, None, 1.0 + i, logprob=-0.5, top_logprobs=[]) for i, t in enumerate(ids[:-1])]
    last = events[-1]
    events[-1] = TokenEvent(0, 0, last.token_id, FinishReason.LENGTH, None, last.time, -0.5, [])  # cut mid-emoji
    chunks = run(tiny_tokenizer, events, 1)
    assert "".join(t for t, _ in chunks) == "a"  # the text cannot show half an emoji
    assert len([tok for _, toks in chunks for tok in toks]) == len(events)  # but each token was output
