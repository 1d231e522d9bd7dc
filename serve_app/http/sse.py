"""Server-sent events: one `data:` line per JSON payload, safe for every client's line reader."""

from __future__ import annotations

import json


def sse(payload: dict) -> str:
    return sse_json(json.dumps(payload, ensure_ascii=False))


# Characters JSON leaves raw but Python's str.splitlines (httpx's aiter_lines, and so many
# Python SSE clients) ends a line at. The model can write them; escaped, an event stays one
# line for every client. Found by the soak (docs/RELIABILITY.md): one stream in 2369 broke.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(text: str) -> str:
    """One SSE event of a JSON text (these characters only occur inside its strings)."""
    return f"data: {text.translate(_LINE_BREAKERS)}\n\n"

