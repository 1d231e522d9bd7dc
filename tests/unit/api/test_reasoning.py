"""The reasoning parsers (serve_app/output/reasoning.py), deepseek_r1 and qwen3: whole and
streamed in every split, the prompt-opened `<think>`, a missing `</think>`, reasoning-token
counts, and Qwen3's templates with thinking on and off."""

from __future__ import annotations

import copy

import pytest

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.translate import to_generate_request
from serve_app.output.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from workers.contract.model_config import ModelConfig
from workers.serving.request_processor import _opens_reasoning
from workers.text.prompts import PromptBuilder

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


# ------------------------------------------------------------------------------ qwen3

# Qwen3's hybrid template: thinking on, the model opens <think> itself; off, the template
# closes an empty one in the prompt. Qwen3 2507 Thinking's opens it in the prompt.
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
QWEN3_THINKING_TEMPLATE = QWEN3_TEMPLATE.replace(
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}", "<think>\n")
# (model output, the template opened the reasoning, expected reasoning, expected content)
QWEN3_OUTPUTS = [
    ("<think>\nCompare the tenths.\n</think>\n\n9.8 is larger.", False, "\nCompare the tenths.\n",
     "\n\n9.8 is larger."),
    ("9.8 is larger.", False, "", "9.8 is larger."),  # thinking off: no tags at all, all content
    ("Compare.\n</think>\n\n9.8", True, "Compare.\n", "\n\n9.8"),
    # the template opened <think> and the model wrote it again: markup, not reasoning
    ("<think>\nCompare.\n</think>\n\n9.8", True, "\nCompare.\n", "\n\n9.8"),
    ("  <think>Compare.</think>9.8", True, "Compare.", "9.8"),
    ("<thinking> is a word</think>ok", True, "<thinking> is a word", "ok"),
    ("<thi", True, "<thi", ""),  # cut off: reasoning, as written
    ("Still thinking", True, "Still thinking", ""),
]


def run_qwen3(pieces: list[str], reasoning_open: bool) -> tuple[str, str]:
    parser = Qwen3ReasoningParser(reasoning_open)
    parts = [parser.push(piece, 1) for piece in pieces] + [parser.finish()]
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), QWEN3_OUTPUTS)
def test_qwen3_whole_and_streamed_in_every_split(text, opened, reasoning, content):
    for pieces in [[text], *([text[:i], text[i:]] for i in range(len(text) + 1)), list(text)]:
        assert run_qwen3(pieces, opened) == (reasoning, content), pieces


def test_deepseek_r1_keeps_a_repeated_start_tag_as_reasoning():
    parser = DeepSeekR1ReasoningParser(reasoning_open=True)
    assert parser.push("<think>a</think>b", 1).reasoning == "<think>a"


@pytest.mark.parametrize(("template", "kwargs", "opened", "output", "reasoning", "content"), [
    (QWEN3_TEMPLATE, {}, False, "<think>\nhmm\n</think>\n\n9.8", "\nhmm\n", "\n\n9.8"),
    (QWEN3_TEMPLATE, {"enable_thinking": False}, False, "9.8", "", "9.8"),
    (QWEN3_THINKING_TEMPLATE, {}, True, "hmm\n</think>\n\n9.8", "hmm\n", "\n\n9.8"),
])
def test_qwen3_templates_and_what_the_worker_reports(tiny_tokenizer, template, kwargs, opened, output, reasoning,
                                                      content):
    """The worker reports an opened reasoning from the rendered prompt; with thinking off the
    prompt ends after `</think>`, so the output is content."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = template
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "9.11 or 9.8?"}],
                                                "chat_template_kwargs": kwargs})
    request = to_generate_request(req, "r", ModelConfig(id="m", reasoning_parser="qwen3"))
    assert request.reasoning_start == "<think>"
    assert _opens_reasoning(PromptBuilder(tokenizer).chat_text(request), request.reasoning_start) is opened
    assert run_qwen3([output], opened) == (reasoning, content)


def test_a_thinking_token_budget_names_the_models_tags_and_needs_a_reasoning_parser():
    """vLLM's thinking_token_budget: the parser's tags go with it to the worker; a model
    without a parser has no section to count (no budget); beam search refuses it."""
    from serve_app.http.errors import APIError
    from serve_app.http.request_body import parse_request

    body = {"model": "m", "messages": [{"role": "user", "content": "9.11 or 9.8?"}], "thinking_token_budget": 64}
    req = parse_request(ChatCompletionRequest, body)
    budget = to_generate_request(req, "r", ModelConfig(id="m", reasoning_parser="qwen3")).params.thinking_budget
    assert (budget.tokens, budget.start, budget.end) == (64, "<think>", "</think>")
    assert to_generate_request(req, "r", ModelConfig(id="m")).params.thinking_budget is None
    for bad in ({"thinking_token_budget": 0}, {"use_beam_search": True, "n": 2}):
        with pytest.raises(APIError) as info:
            parse_request(ChatCompletionRequest, {**body, **bad})
        assert (info.value.status, info.value.param) == (400, "thinking_token_budget")
