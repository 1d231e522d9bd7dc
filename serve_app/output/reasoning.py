"""Reasoning output: `<think>...</think>` split off into `reasoning_content`.

Used by `/v1/chat/completions` only; `/lm/v2` keeps the tags inside `content` (seed 004).
The output starts inside the reasoning when it opens with `<think>`, or when the chat
template already opened it at the end of the prompt (the worker reports that on the
chunks: `GenerationChunk.reasoning_open`). Everything up to `</think>` is reasoning; an
output cut off before `</think>` is all reasoning. Text that may be the start of a tag
is held back until decided. An output that neither opens with `<think>` nor starts
inside an opened one is all content.

- `deepseek_r1` (DeepSeek R1, and the default reading of the tags).
- `qwen3` (Qwen3, QwQ): the same tags. Thinking switched off (`enable_thinking: false`)
  the template closes an empty `<think></think>` in the prompt, so the output is all
  content; a thinking-only template (Qwen3 2507 Thinking) opens `<think>` in the prompt,
  and the model may still write `<think>` again first: that repeated tag is markup.

Reasoning tokens: tokens arrive in chunks with their text. A chunk wholly inside the
reasoning counts all its tokens; a chunk that closes it counts its share of the
chunk's characters up to and including `</think>` (rounded up). The worker yields a
chunk per engine step, usually one token, which makes the count exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serve_app.output.tags import held_prefix


@dataclass
class ReasoningOutput:
    reasoning: str = ""
    content: str = ""


class DeepSeekR1ReasoningParser:
    START, END = "<think>", "</think>"
    special_tags = False  # the tags are read from text decoded as the request asks

    def __init__(self, reasoning_open: bool = False) -> None:
        self._state = "reasoning" if reasoning_open else "start"  # start -> reasoning -> content
        self._buffer = ""
        self._saw_reasoning = reasoning_open
        self._undecided_tokens = 0  # tokens pushed while the output may still open <think>
        self.reasoning_tokens = 0

    def push(self, text: str, num_tokens: int = 0) -> ReasoningOutput:
        was_in_content = self._state == "content"
        out = self._push(text)
        if was_in_content:
            return out
        tokens, self._undecided_tokens = self._undecided_tokens + num_tokens, 0
        if self._state == "start":
            self._undecided_tokens = tokens
        elif self._saw_reasoning:
            self.reasoning_tokens += self._reasoning_share(text, out, tokens)
        return out

    def finish(self) -> ReasoningOutput:
        text, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            return ReasoningOutput(reasoning=text)
        self._state = "content"
        return ReasoningOutput(content=text)

    def _push(self, text: str) -> ReasoningOutput:
        self._buffer += text
        out = ReasoningOutput()
        if self._state == "start":
            head = self._buffer.lstrip()
            if self.START.startswith(head):
                return out  # may still become <think>
            if head.startswith(self.START):
                self._state, self._buffer = "reasoning", head[len(self.START):]
                self._saw_reasoning = True
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buffer.find(self.END)
            if end < 0:
                keep = held_prefix(self._buffer, self.END)
                out.reasoning, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                return out
            out.reasoning = self._buffer[:end]
            self._state, self._buffer = "content", self._buffer[end + len(self.END):]
        out.content, self._buffer = self._buffer, ""
        return out

    def _reasoning_share(self, text: str, out: ReasoningOutput, num_tokens: int) -> int:
        if self._state != "content" or not out.content or not text:
            return num_tokens  # still inside (or the chunk ended exactly at the tag)
        share = max(0, len(text) - len(out.content)) / len(text)
        return math.ceil(num_tokens * share)


class Qwen3ReasoningParser(DeepSeekR1ReasoningParser):
    def __init__(self, reasoning_open: bool = False) -> None:
        super().__init__(reasoning_open)
        self._may_repeat_start = reasoning_open  # the template opened <think>: the model may write it again

    def _push(self, text: str) -> ReasoningOutput:
        if self._may_repeat_start:
            self._buffer += text
            head = self._buffer.lstrip()
            if self.START.startswith(head):
                return ReasoningOutput()  # still whitespace, or a prefix of the tag
            self._may_repeat_start = False
            text, self._buffer = head[len(self.START):] if head.startswith(self.START) else self._buffer, ""
        return super()._push(text)

