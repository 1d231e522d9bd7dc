"""Finding tags in text that arrives in pieces (tool calls, reasoning)."""

from __future__ import annotations


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`: the part
    a streaming parser must hold back until the next piece decides it."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
