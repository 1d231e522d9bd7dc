"""Incremental detokenization: token ids in, exactly the new text out.

Decoding one token alone loses context (a leading-space marker, half of a multi-byte
character), so each step decodes a short window twice: the tokens before the new ones
(`prefix`) and the window including them; the new text is the difference. A window
that ends in U+FFFD is an incomplete UTF-8 sequence: its text waits for more tokens.
The window is seeded with the last prompt tokens so the first output token decodes
with its real left context.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
