"""Incremental detokenization against one-shot tokenizer.decode."""

from __future__ import annotations

import pytest

from workers.text.detokenizer import IncrementalDetokenizer, window_decoder

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "你好 世界",
    "emoji 😀 and 🎉 party",
    "café naïve",
    "日本語のテキスト",
    "mixed: a😀b你c é 🎉🎉",
    "def add(a, b):\n    return a + b\n",
    "  leading and   repeated   spaces ",
]


def stream(tokenizer, prompt_ids: list[int], ids: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    pieces = [detok.push(i) for i in ids]
    assert detok.text == "".join(pieces)
    return pieces


def test_texts_really_split_characters_across_tokens(tiny_tokenizer):
    # The check below is only meaningful if some tokens hold part of a character.
    partial = [
        i
        for text in TEXTS
        for i in tiny_tokenizer(text)["input_ids"]
        if "\ufffd" in tiny_tokenizer.decode([i])
    ]
    assert len(partial) > 5


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tiny_tokenizer, text):
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = stream(tiny_tokenizer, [], ids)
    assert "".join(pieces) == tiny_tokenizer.decode(ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_with_prompt_context(tiny_tokenizer, text):
    prompt_ids = tiny_tokenizer("Hello! How can I assist you today? 你")["input_ids"]
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = stream(tiny_tokenizer, prompt_ids, ids)
    whole = tiny_tokenizer.decode(prompt_ids + ids)
    prompt_text = tiny_tokenizer.decode(prompt_ids)
    assert whole.startswith(prompt_text)
    assert "".join(pieces) == whole[len(prompt_text) :]


def test_multibyte_character_is_emitted_once_complete(tiny_tokenizer):
    ids = tiny_tokenizer("😀", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 2  # the emoji spans several byte tokens
    pieces = stream(tiny_tokenizer, [], ids)
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "😀"


def test_special_tokens_skipped_or_kept(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    ids = tiny_tokenizer("Hello", add_special_tokens=False)["input_ids"] + [eos]
    skipped = "".join(stream(tiny_tokenizer, [], ids, skip=True))
    kept = "".join(stream(tiny_tokenizer, [], ids, skip=False))
    assert skipped == tiny_tokenizer.decode(ids, skip_special_tokens=True) == "Hello"
    assert kept == tiny_tokenizer.decode(ids, skip_special_tokens=False) == "Hello<|im_end|>"


class _RecordingTokenizer:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids, **kwargs):
        self.window_sizes.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)


def test_long_generation_decodes_short_windows(tiny_tokenizer):
    text = " ".join(TEXTS) * 3
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    recorder = _RecordingTokenizer(tiny_tokenizer)
    detok = IncrementalDetokenizer(recorder, [], True)
    for i in ids:
        detok.push(i)
    assert detok.text == text
    # Each step decodes a short window, not the whole history (cost per token stays flat).
    assert len(ids) > 200
    assert max(recorder.window_sizes) <= 12


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_decoder_gives_transformers_text(tiny_tokenizer, skip):
    """The fast path decodes with the Rust tokenizer directly: the same text as the wrapper,
    every window of every test text, special tokens skipped or kept."""
    decode = window_decoder(tiny_tokenizer, skip)
    assert decode.func == tiny_tokenizer.backend_tokenizer.decode
    ids = tiny_tokenizer(" ".join(TEXTS), add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    for start in range(0, len(ids) - 6):
        window = ids[start : start + 6]
        assert decode(window) == tiny_tokenizer.decode(window, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(tiny_tokenizer, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tiny_tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                        True, raising=False)
    assert window_decoder(tiny_tokenizer, True).func == tiny_tokenizer.decode
