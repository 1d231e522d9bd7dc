"""The deepseek_r1 reasoning parser (serve_app/output/reasoning.py): whole and streamed in every
split, the prompt-opened `<think>`, a missing `</think>`, and reasoning-token counts."""

from __future__ import annotations

import pytest

from serve_app.output.reasoning import DeepSeekR1ReasoningParser

# (model output, output starts inside the reasoning, expected reasoning, expected content)
OUTPUTS = [
    ("<think>\nCompare the tenths: 8 > 1.\n</think>\n\n9.8 is larger.", False,
     "\nCompare the tenths: 8 > 1.\n", "\n\n9.8 is larger."),
    # the chat template opened <think> at the end of the prompt: the output starts inside it
    ("Compare the tenths.\n</think>\n\n9.8 is larger.", True, "Compare the tenths.\n", "\n\n9.8 is larger."),
    # cut off (max_tokens) before </think>: all of it is reasoning
    ("<think>\nFirst, the integer parts are equal", False, "\nFirst, the integer parts are equal", ""),
    ("Still thinking", True, "Still thinking", ""),
    # no reasoning at all
    ("9.8 is larger.", False, "", "9.8 is larger."),
    ("<thing> is not a tag", False, "", "<thing> is not a tag"),
    ("a </think> before any <think> is content", False, "", "a </think> before any <think> is content"),
    ("<think></think>Direct answer.", False, "", "Direct answer."),
]


def run(pieces: list[str], reasoning_open: bool) -> tuple[str, str]:
    parser = DeepSeekR1ReasoningParser(reasoning_open)
    reasoning = content = ""
    for piece in pieces:
        out = parser.push(piece, 1)
        reasoning += out.reasoning
        content += out.content
    last = parser.finish()
    return reasoning + last.reasoning, content + last.content


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), OUTPUTS)
def test_whole_and_streamed_in_every_split(text, opened, reasoning, content):
    assert run([text], opened) == (reasoning, content)
    for i in range(len(text) + 1):
        assert run([text[:i], text[i:]], opened) == (reasoning, content), i
    assert run(list(text), opened) == (reasoning, content)


def test_a_possible_end_tag_is_held_back_until_decided():
    parser = DeepSeekR1ReasoningParser(reasoning_open=True)
    assert parser.push("hmm </thi", 1).reasoning == "hmm "
    out = parser.push("nk>Yes", 1)
    assert (out.reasoning, out.content) == ("", "Yes")


def test_reasoning_tokens_count_tokens_up_to_the_end_tag(tiny_tokenizer):
    text = "<think>\nLet me think about it.\n</think>\n\nThe answer is 42."
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tiny_tokenizer.decode([i]) for i in ids]
    parser = DeepSeekR1ReasoningParser()
    for piece in pieces:
        parser.push(piece, 1)
    reasoning_end = text.index("</think>") + len("</think>")
    # one token a chunk: exactly the tokens whose text lies (or ends) inside the reasoning
    expected, seen = 0, 0
    for piece in pieces:
        if seen < reasoning_end:
            expected += 1
        seen += len(piece)
    assert parser.reasoning_tokens == expected
    assert 0 < parser.reasoning_tokens < len(ids)


def test_reasoning_tokens_of_multi_token_chunks_and_of_an_answer_without_reasoning():
    parser = DeepSeekR1ReasoningParser(reasoning_open=True)
    parser.push("abc", 3)
    parser.push("de</think>", 4)
    parser.push("xyz", 3)
    assert parser.reasoning_tokens == 7
    plain = DeepSeekR1ReasoningParser()
    plain.push("<", 1)  # undecided: not counted unless it opens the reasoning
    plain.push("b>bold</b>", 3)
    assert plain.reasoning_tokens == 0
