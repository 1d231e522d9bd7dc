"""Output constraints as llguidance grammars, checked without a tokenizer or torch.

The ingress validates a request's constraint here before any worker sees it; the
worker compiles the same grammar text against its tokenizer (workers/sampling/guided.py).
"""

from __future__ import annotations

import json

import llguidance

from workers.contract.errors import WorkerError
from workers.contract.sampling_params import GuidedDecoding

# Compact JSON (no free whitespace between tokens) keeps outputs short and stops a model
# from spending its budget on blank lines; a schema may override it with "x-guidance".
JSON_DEFAULTS = {"whitespace_flexible": False}


class GuidedDecodingError(WorkerError, ValueError):
    """The grammar cannot be compiled, or the request cannot be guided; `param` is the
    request's constraint field (`GuidedDecoding.param`)."""

    code = "invalid_grammar"
    prefix = "the output constraint cannot be used: "


def grammar_text(guided: GuidedDecoding) -> str:
    """The llguidance grammar for a constraint (not yet checked)."""
    if guided.kind == "json_schema":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(guided.spec, defaults=JSON_DEFAULTS)
        except ValueError as exc:
            raise GuidedDecodingError(f"the schema is not a JSON object: {exc}", guided.param) from exc
    if guided.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(guided.spec)
    if guided.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(guided.spec)
    raise GuidedDecodingError(f"unknown guided decoding kind {guided.kind!r}", guided.param)


def lark_json(schema: dict) -> str:
    """`%json {...}` for embedding `schema` in a Lark grammar, compact like a json_schema
    constraint (a bare `%json` allows free whitespace between every token)."""
    options = {**JSON_DEFAULTS, **schema.get("x-guidance", {})}
    return "%json " + json.dumps({**schema, "x-guidance": options})


def grammar_error(guided: GuidedDecoding) -> str | None:
    """Why llguidance rejects this constraint, or None. Needs no tokenizer, so the API edge
    calls it before a request reaches a worker."""
    try:
        message = llguidance.LLMatcher.validate_grammar(grammar_text(guided))
    except GuidedDecodingError as exc:
        return str(exc)
    return message.strip() or None

