"""JSON text written by a client or a model (tool-call arguments), parsed safely."""

from __future__ import annotations

import json
from typing import Any


def loads_json_text(text: str) -> Any:
    """json.loads, except that nesting past Python's recursion limit is a ValueError like
    any other malformed text (callers then keep the text as it is), not a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON text nested too deeply") from None
