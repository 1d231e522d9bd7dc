"""Lone UTF-16 surrogates in request text.

JSON may carry them as escapes (`"\\ud800"`) and Python's json module keeps them, but
they are not Unicode text: the tokenizer raises TypeError on them (which failed the
worker call: a 503), and UTF-8 encoding raises UnicodeEncodeError (which failed the
error response that quoted them: a bare 500). The ingress refuses such a request with
a 400 naming the field. Escaped pairs (`"\\ud83d\\ude00"`) decode to one character and pass.
"""

from __future__ import annotations

from collections import deque
from typing import Any


def lone_surrogate_path(value: Any) -> str | None:
    """The dotted path of the first string (or object key) holding a lone surrogate,
    shallowest first; None if there is none. Iterative, and each path is a linked
    (key, parent) pair until it is needed: any nesting depth is safe and linear."""
    queue: deque[tuple[tuple | None, Any]] = deque([(None, value)])
    while queue:
        path, item = queue.popleft()
        if isinstance(item, str):
            if has_lone_surrogate(item):
                return _dotted(path)
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and has_lone_surrogate(key):
                    return _dotted((key, path))
                queue.append(((key, path), child))
        elif isinstance(item, (list, tuple)):
            queue.extend(((index, path), child) for index, child in enumerate(item))
    return None


def _dotted(path: tuple | None) -> str:
    keys = []
    while path is not None:
        key, path = path
        keys.append(str(key))
    return ".".join(reversed(keys))


def has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
