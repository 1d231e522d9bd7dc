"""Server-sent events: one `data:` line per JSON payload, safe for every client's line reader."""

from __future__ import annotations

import json

# json.dumps builds a new encoder on every call that sets an option: 1 µs a call against
# 0.1 for one encoder kept (the same text).
json_text = json.JSONEncoder(ensure_ascii=False).encode


def sse(payload: dict) -> str:
    return sse_json(json_text(payload))


# Characters JSON leaves raw but Python's str.splitlines (httpx's aiter_lines, and so many
# Python SSE clients) ends a line at. The model can write them; escaped, an event stays one
# line for every client. Found by the soak (docs/RELIABILITY.md): one stream in 2369 broke.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(text: str) -> str:
    """One SSE event of a JSON text (these characters only occur inside its strings)."""
    if not text.isascii():  # the breakers are not ASCII: most events skip the 3 µs scan
        text = text.translate(_LINE_BREAKERS)
    return f"data: {text}\n\n"

