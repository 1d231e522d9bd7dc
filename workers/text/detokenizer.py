"""Incremental detokenization: token ids in, exactly the new text out.

Decoding one token alone loses context (a leading-space marker, half of a multi-byte
character), so each step decodes a short window twice: the tokens before the new ones
(`prefix`) and the window including them; the new text is the difference. A window
that ends in U+FFFD is an incomplete UTF-8 sequence: its text waits for more tokens.
The window is seeded with the last prompt tokens so the first output token decodes
with its real left context.

A fast (Rust) tokenizer's windows are decoded by the Rust tokenizer itself where
transformers' `decode` would return the same text (no clean-up of spaces applies):
its wrapper costs several times the decode on a short window, twice a token, on the
worker's event loop beside the engine thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import tokenizers

_CONTEXT_TOKENS = 5


def window_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`ids -> text`, as `tokenizer.decode(ids, skip_special_tokens=...)` gives it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and not _cleans_up_spaces(tokenizer, backend):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


def _cleans_up_spaces(tokenizer, backend: tokenizers.Tokenizer) -> bool:
    """Whether transformers' decode rewrites the Rust text (clean_up_tokenization_spaces;
    transformers skips it for BPE models unless forced)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(backend.model).__name__ != "BPE" or forced


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._decode = window_decoder(tokenizer, skip_special_tokens)
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
