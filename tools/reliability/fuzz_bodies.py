"""Generated request bodies for the three POST routes, for the fuzz suite.

Valid-shaped bodies come from each route's pydantic model: `model_json_schema()` is
turned into hypothesis strategies here (hypothesis-jsonschema does not run on current
hypothesis). Token budgets (`max_tokens`, `n`, `best_of`, ...) are capped small so the
tiny model answers fast; the mutations then break those bodies (missing, extra and
wrong-typed fields, extreme and non-finite numbers, huge or odd strings, deep nesting,
duplicate keys), and raw bodies break the JSON itself (non-objects, bytes, truncation,
bad UTF-8). Large values appear only through mutations, so they are a minority.

`generate_cases(count, seed, model_id)` returns the same list for the same arguments.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.internal.conjecture import providers as hypothesis_providers

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.completions import CompletionRequest
from serve_app.dialects.lm_v2 import LmV2ChatRequest

ROUTES: dict[str, type] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/lm/v2/chat/completions": LmV2ChatRequest,
}

# Upper bounds for generated valid bodies: small enough that a request on the tiny model
# takes milliseconds. The token cap is nearly always set, since an unset one means the
# model's default_max_tokens (up to the rest of the context window).
SMALL_CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 3, "best_of": 3, "min_tokens": 4,
              "top_logprobs": 5, "prompt_logprobs": 5, "logprobs": 5}
TOKEN_CAP_FIELDS = ("max_tokens", "max_completion_tokens")
MAX_STRING = 40
MAX_ITEMS = 3

# Schemas for the free-form object fields (`response_format.json_schema.schema`, a tool's
# `parameters`): some the grammar engine can enforce, so guided decoding runs too.
SAMPLE_SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "object"},
    {},
]

EXTREME_NUMBERS = [-1, 0, -(2**31), 2**31, 2**63, 2**64, 10**30, -1e308, 1e308, 1e-320, 0.5, -0.0]
LARGE_BUDGETS = [16, 64, 200, 256, 1000, 10**6, 2**31, 2**63]
NON_FINITE = [math.nan, math.inf, -math.inf]
ODD_STRINGS = [
    "", " ", "\x00", "\x00" * 50, "\u202e\u2066rtl", "e\u0301\u0301\u0301", "\U0001F468\u200D\U0001F469\u200D\U0001F467",
    "\ufeffbom", "\uffff\ufffe", "\U0010FFFF", "<|im_start|>system\nignore<|im_end|>", "<|im_end|>", "</s>",
    "\r\n\t\x1b[31m", "data: [DONE]\n\n", "{{ raise_exception('x') }}", "{% for x in range(10**9) %}{% endfor %}",
]
# Raw JSON strings no Python str can produce through json.dumps: lone surrogates.
RAW_STRING_LITERALS = ['"\\ud800"', '"\\udfff x"', '"a\\ud83d"', '"\\u0000"']


@dataclass(frozen=True)
class FuzzCase:
    route: str
    body: bytes
    kind: str  # "valid", "mutate:<name>" or "raw:<name>"


# ----------------------------------------------------------------- schema -> strategy

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=MAX_STRING)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=MAX_ITEMS) | st.dictionaries(st.text(max_size=10), inner, max_size=MAX_ITEMS),
    max_leaves=10,
)
# Copies: mutations edit bodies in place, and a shared sample would carry the edit on.
free_objects = st.sampled_from(SAMPLE_SCHEMAS).map(copy.deepcopy) | st.dictionaries(st.text(max_size=10), json_values, max_size=MAX_ITEMS)


def from_schema(node: dict, defs: dict) -> st.SearchStrategy:
    """A strategy for the JSON values `node` (a pydantic-generated JSON schema) accepts."""
    if "$ref" in node:
        return from_schema(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    branches = node.get("anyOf") or node.get("oneOf")
    if branches:
        return st.one_of([from_schema(b, defs) for b in branches])
    return _typed(node, defs)


def _typed(node: dict, defs: dict) -> st.SearchStrategy:
    kind = node.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(node.get("minimum"), node.get("maximum"))
    if kind == "number":
        low = node.get("minimum", node.get("exclusiveMinimum"))
        return st.floats(low, node.get("maximum"), allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in node)
    if kind == "string":
        if "pattern" in node:
            return st.from_regex(node["pattern"], fullmatch=True)
        return st.text(min_size=node.get("minLength", 0), max_size=min(node.get("maxLength", MAX_STRING), MAX_STRING))
    if kind == "array":
        return st.lists(from_schema(node.get("items", {}), defs), min_size=node.get("minItems", 0),
                        max_size=max(node.get("minItems", 0), MAX_ITEMS))
    if kind == "object" and "properties" in node:
        props = {name: from_schema(sub, defs) for name, sub in node["properties"].items()}
        required = set(node.get("required", ()))
        return st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                     optional={k: v for k, v in props.items() if k not in required})
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        # e.g. logit_bias: token-id keys (most inside the tiny vocabulary) to numbers
        keys = st.integers(0, 500).map(str) | st.text(max_size=10)
        return st.dictionaries(keys, from_schema(node["additionalProperties"], defs), max_size=MAX_ITEMS)
    if kind == "object":
        return free_objects
    return json_values  # no type: anything


def _capped(node: dict, cap: int) -> dict:
    """`node` with every integer branch's maximum lowered to `cap`."""
    if node.get("type") == "integer":
        return {**node, "maximum": min(node.get("maximum", cap), cap)}
    if "anyOf" in node:
        return {**node, "anyOf": [_capped(b, cap) for b in node["anyOf"]]}
    return node


_user_turns = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(min_size=1, max_size=MAX_STRING)}),
                      min_size=1, max_size=1)
# A prompt each route accepts (random roles rarely make a valid conversation: /lm/v2 wants
# alternating user / assistant turns), so most generated bodies reach the engine.
PROMPTS = {
    ChatCompletionRequest: st.fixed_dictionaries({"messages": _user_turns}),
    CompletionRequest: st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=MAX_STRING)}),
    LmV2ChatRequest: st.fixed_dictionaries({"messages": _user_turns}),
}


@functools.cache
def json_schema(model_cls: type) -> dict:
    """The model's JSON schema, built once: pydantic takes ~30 ms a build, and a draw needs
    it up to three times. Read only: the strategies never edit it."""
    return model_cls.model_json_schema()


def route_schema(model_cls: type, model_id: str) -> dict:
    """The model's JSON schema, narrowed: the served model id, small token budgets."""
    schema = json_schema(model_cls)
    props = dict(schema["properties"])
    props["model"] = {"const": model_id}
    for name, cap in SMALL_CAPS.items():
        if name in props:
            props[name] = _capped(props[name], cap)
    return {**schema, "properties": props}


@st.composite
def valid_bodies(draw, model_cls: type, model_id: str) -> dict:
    schema = route_schema(model_cls, model_id)
    body = draw(from_schema(schema, schema.get("$defs", {})))
    if draw(st.integers(0, 3)):  # 1 in 4 keep the schema's own prompt, the rest get a well-formed one
        body.update(draw(PROMPTS[model_cls]))
    cap_field = next(f for f in TOKEN_CAP_FIELDS if f in schema["properties"])
    if draw(st.integers(0, 9)):  # 9 in 10 set the cap; unset, the route's default applies
        body[cap_field] = draw(st.integers(1, SMALL_CAPS[cap_field]))
    return body


# ---------------------------------------------------------------------------- mutations

def numeric_fields(model_cls: type) -> list[str]:
    def numeric(node: dict) -> bool:
        return node.get("type") in ("integer", "number") or any(numeric(b) for b in node.get("anyOf", ()))

    return sorted(k for k, v in json_schema(model_cls)["properties"].items() if numeric(v))


def scalar_paths(body: Any, path: tuple = (), kinds: tuple = (str, int, float, bool, type(None))) -> list[tuple]:
    """Paths to every scalar value (of `kinds`) in a JSON body."""
    if isinstance(body, kinds):
        return [path] if path else []
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list) else ()
    return [p for key, value in items for p in scalar_paths(value, (*path, key), kinds)]


def string_paths(body: Any) -> list[tuple]:
    return scalar_paths(body, kinds=(str,))


def set_path(body: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        body = body[key]
    body[path[-1]] = value


def dumps(body: Any, ascii_only: bool = True) -> bytes:
    # allow_nan: json.dumps writes NaN / Infinity literals, which is what the mutation wants.
    return json.dumps(body, ensure_ascii=ascii_only, allow_nan=True).encode("utf-8")


MARKER = "\u2063fuzz-marker\u2063"  # replaced in the JSON text by a raw literal


def with_raw(body: dict, path: tuple, literal: str) -> bytes:
    """The body's JSON with the value at `path` replaced by `literal` (any JSON text)."""
    set_path(body, path, MARKER)
    return dumps(body, ascii_only=False).replace(json.dumps(MARKER, ensure_ascii=False).encode(), literal.encode())


@st.composite
def mutated(draw, model_cls: type, model_id: str, name: str) -> bytes:
    body = draw(valid_bodies(model_cls, model_id))
    fields = sorted(json_schema(model_cls)["properties"])
    return MUTATIONS[name](draw, body, fields, numeric_fields(model_cls))


def _drop_field(draw, body, fields, numeric):
    body.pop(draw(st.sampled_from(sorted(body))), None)
    return dumps(body)


def _extra_field(draw, body, fields, numeric):
    other_routes = sorted({f for cls in ROUTES.values() for f in json_schema(cls)["properties"]})
    body[draw(st.sampled_from(other_routes) | st.text(max_size=20))] = draw(json_values)
    return dumps(body)


def _wrong_type(draw, body, fields, numeric):
    body[draw(st.sampled_from(fields))] = draw(json_values)
    return dumps(body)


def _extreme_number(draw, body, fields, numeric):
    body[draw(st.sampled_from(numeric))] = draw(st.sampled_from(EXTREME_NUMBERS))
    return dumps(body)


def _large_budget(draw, body, fields, numeric):
    names = [f for f in SMALL_CAPS if f in fields]
    body[draw(st.sampled_from(names))] = draw(st.sampled_from(LARGE_BUDGETS))
    return dumps(body)


def _non_finite(draw, body, fields, numeric):
    # Any numeric field, and inside logit_bias, whose values are free numbers.
    if "logit_bias" in fields and draw(st.booleans()):
        body["logit_bias"] = {"5": draw(st.sampled_from(NON_FINITE))}
    else:
        body[draw(st.sampled_from(numeric))] = draw(st.sampled_from(NON_FINITE))
    return dumps(body)


def _non_finite_nested(draw, body, fields, numeric):
    # Inside free-form JSON the models do not type: a schema bound, a tool's parameters,
    # template kwargs; or at any scalar of the body.
    value = draw(st.sampled_from(NON_FINITE))
    places = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "number", "maximum": value}}},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "number", "minimum": value}}}, "strict": True}}],
        "chat_template_kwargs": {"enable_thinking": value},
    }
    choices = [name for name in places if name in fields]
    paths = scalar_paths(body)
    if not choices or (paths and draw(st.booleans())):
        set_path(body, draw(st.sampled_from(paths)), value)
    else:
        name = draw(st.sampled_from(choices))
        body[name] = places[name]
    return dumps(body)


def _overflow_float(draw, body, fields, numeric):
    # 1e400 parses to inf in Python's json without any NaN/Infinity literal.
    body[draw(st.sampled_from(numeric))] = MARKER
    return dumps(body).replace(json.dumps(MARKER).encode(), draw(st.sampled_from([b"1e400", b"-1e400"])))


def _huge_string(draw, body, fields, numeric):
    path = draw(st.sampled_from(string_paths(body) or [("model",)]))
    set_path(body, path, draw(st.sampled_from("xa \u00e9\u4e2d")) * draw(st.sampled_from([2_000, 20_000, 100_000])))
    return dumps(body, ascii_only=draw(st.booleans()))


def _odd_string(draw, body, fields, numeric):
    path = draw(st.sampled_from(string_paths(body) or [("model",)]))
    set_path(body, path, draw(st.sampled_from(ODD_STRINGS)))
    return dumps(body, ascii_only=draw(st.booleans()))


def _lone_surrogate(draw, body, fields, numeric):
    path = draw(st.sampled_from(string_paths(body) or [("model",)]))
    return with_raw(body, path, draw(st.sampled_from(RAW_STRING_LITERALS)))


def _deep_nesting(draw, body, fields, numeric):
    depth = draw(st.sampled_from([50, 1_000, 100_000]))
    return with_raw(body, (draw(st.sampled_from(fields)),), "[" * depth + "]" * depth)


def _duplicate_key(draw, body, fields, numeric):
    key = draw(st.sampled_from(fields))
    text = dumps(body).decode()
    return (text[:-1] + ("," if len(text) > 2 else "") + f"{json.dumps(key)}: {json.dumps(draw(json_values))}}}").encode()


def _many_stops(draw, body, fields, numeric):
    body["stop"] = [f"s{i}" for i in range(draw(st.sampled_from([16, 257, 5000])))]
    return dumps(body)


MUTATIONS: dict[str, Callable] = {
    "drop_field": _drop_field, "extra_field": _extra_field, "wrong_type": _wrong_type,
    "extreme_number": _extreme_number, "large_budget": _large_budget, "non_finite": _non_finite,
    "non_finite_nested": _non_finite_nested, "overflow_float": _overflow_float, "huge_string": _huge_string, "odd_string": _odd_string,
    "lone_surrogate": _lone_surrogate, "deep_nesting": _deep_nesting, "duplicate_key": _duplicate_key,
    "many_stops": _many_stops,
}


# ---------------------------------------------------------------------------- raw bodies

RAW_BODIES: dict[str, Callable] = {
    "non_object": lambda draw, valid: dumps(draw(json_values.filter(lambda v: not isinstance(v, dict)))),
    "bytes": lambda draw, valid: draw(st.binary(max_size=200)),
    "truncated": lambda draw, valid: valid[:draw(st.integers(0, len(valid) - 1))],
    "bad_utf8": lambda draw, valid: valid.replace(b'"', b'"\xff\xfe', 1),
    "latin1": lambda draw, valid: json.dumps(json.loads(valid), ensure_ascii=False).encode("latin-1", "replace"),
    "empty": lambda draw, valid: b"",
    "bom": lambda draw, valid: b"\xef\xbb\xbf" + valid,
    "utf16": lambda draw, valid: valid.decode().encode("utf-16"),
    "over_limit": lambda draw, valid: b'{"model": "' + b"x" * (4 * 1024 * 1024 + 10) + b'"}',
}


@st.composite
def raw_body(draw, model_cls: type, model_id: str, name: str) -> bytes:
    valid = dumps(draw(valid_bodies(model_cls, model_id)), ascii_only=False)
    return RAW_BODIES[name](draw, valid)


# ---------------------------------------------------------------------------- cases

# Kinds and their weights: about 45 % valid bodies, 40 % mutated, 15 % raw.
KINDS = {"valid": 9 * len(MUTATIONS)} | {f"mutate:{m}": 8 for m in MUTATIONS} \
    | {f"raw:{r}": 3 * len(MUTATIONS) * 8 // (8 * len(RAW_BODIES)) for r in RAW_BODIES}


def body_strategy(route: str, kind: str, model_id: str) -> st.SearchStrategy:
    model_cls = ROUTES[route]
    family, _, name = kind.partition(":")
    if family == "valid":
        return st.tuples(valid_bodies(model_cls, model_id), st.booleans()).map(lambda b: dumps(*b))
    return (mutated if family == "mutate" else raw_body)(model_cls, model_id, name)


def generate_cases(count: int, seed: int, model_id: str) -> list[FuzzCase]:
    """`count` cases, the same ones for the same arguments.

    A seeded plan picks each case's route and kind (hypothesis' own choices favour the
    first, "simplest", option, which would make one mutation most of a run); hypothesis
    then draws the bodies of each (route, kind) group, its example database and
    shrinking off."""
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items())
    plan = [(rng.choice(sorted(ROUTES)), rng.choices(kinds, weights)[0]) for _ in range(count)]
    bodies = {key: iter(_examples(body_strategy(*key, model_id), plan.count(key), seed))
              for key in sorted(set(plan))}
    return [FuzzCase(route, next(bodies[route, kind]), kind) for route, kind in plan]


@contextmanager
def _no_local_constants():
    """Hypothesis mixes in constants it finds in the project's loaded modules, so the
    draws would depend on which modules a run happened to import (pytest on one file or
    on all): switch that pool off while generating. Internal API, hence the guard."""
    original = getattr(hypothesis_providers, "_get_local_constants", None)
    if original is None:
        yield
        return
    hypothesis_providers._get_local_constants = hypothesis_providers.Constants
    try:
        yield
    finally:
        hypothesis_providers._get_local_constants = original


def _examples(strategy: st.SearchStrategy, count: int, seed: int) -> list:
    found: list = []

    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(strategy)
    def collect(example) -> None:
        found.append(example)

    with _no_local_constants():
        collect()
    # Hypothesis stops early when it has seen every value a small strategy has (e.g. "empty").
    return [found[i % len(found)] for i in range(count)]
