"""The model's default output cap (`default_max_tokens`): validated in the config, applied
by the worker to a request that names no cap, never past the context window."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from tests.support.engines import (
    chat_request,
    generate,
    make_engine,
    template_ids,
    with_async_engine,
)
from workers.contract.model_config import DEFAULT_MAX_TOKENS, ModelConfig
from workers.serving.request_processor import RequestProcessor

TEXT = "Hi there, what is the capital of France?"


def completion_tokens(paged_model, tokenizer, default: int | None, requested: int | None) -> int:
    engine = make_engine(paged_model, max_model_len=64)

    async def body(aengine):
        processor = RequestProcessor(aengine, tokenizer, default_max_tokens=default)
        return [c async for c in generate(processor, chat_request(TEXT, requested, ignore_eos=True))]

    chunks = asyncio.run(with_async_engine(engine, body))
    assert all(c.error is None for c in chunks) and chunks[-1].finish_reason == "length"
    return chunks[-1].completion_tokens


def test_the_default_caps_a_request_without_one(paged_model, tiny_tokenizer):
    room = 64 - len(template_ids(tiny_tokenizer, TEXT))
    assert completion_tokens(paged_model, tiny_tokenizer, default=5, requested=None) == 5
    assert completion_tokens(paged_model, tiny_tokenizer, default=5, requested=7) == 7  # the request's own wins
    assert completion_tokens(paged_model, tiny_tokenizer, default=1000, requested=None) == room  # the window rules
    assert completion_tokens(paged_model, tiny_tokenizer, default=None, requested=None) == room


def test_config_field():
    assert ModelConfig(id="m").default_max_tokens == DEFAULT_MAX_TOKENS
    assert ModelConfig(id="m", default_max_tokens=None).default_max_tokens is None  # no cap: the window
    # a cap over the window is no error: the worker takes the smaller (the window is often the model's own)
    small_window = ModelConfig(id="m", engine={"max_model_len": 256})
    assert ModelConfig.model_validate(small_window.model_dump()).default_max_tokens == DEFAULT_MAX_TOKENS
    for bad in (0, -1, "many"):
        with pytest.raises(ValidationError, match="default_max_tokens"):
            ModelConfig(id="m", default_max_tokens=bad)
