"""Speculative decoding through the worker's request path (RequestProcessor over the
engine thread): several tokens of one request come out of one step, and the chunks,
text, usage and stop strings are what they are without speculation."""

from __future__ import annotations

import asyncio

from tests.support.engines import (
    chat_request,
    generate,
    make_engine,
    wait_idle,
    with_async_engine,
)
from workers.core.limits import SpeculativeLimits
from workers.serving.request_processor import RequestProcessor

NGRAM = SpeculativeLimits(num_tokens=4, lookup_min=1, lookup_max=3, disable_by_batch_size=None)
TEXT = "the cat sat on the mat, the cat sat on the mat, the cat sat on the mat, the cat"


def _chunks(model, tokenizer, speculative, **params):
    engine = make_engine(model, max_model_len=512, speculative=speculative)

    async def body(aengine):
        processor = RequestProcessor(aengine, tokenizer)
        chunks = [c async for c in generate(processor, chat_request(TEXT, 40, ignore_eos=True, **params))]
        await wait_idle(aengine)
        return chunks

    chunks = asyncio.run(with_async_engine(engine, body))
    assert engine.blocks.num_used_blocks == 0 and engine.num_active == 0
    return chunks, engine


def _summary(chunks):
    last = chunks[-1]
    return ("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], last.finish_reason,
            last.stop_reason, last.completion_tokens)


def test_chunks_text_and_usage_as_without_speculation(paged_model, tiny_tokenizer):
    plain, _ = _chunks(paged_model, tiny_tokenizer, None)
    spec, engine = _chunks(paged_model, tiny_tokenizer, NGRAM)
    assert _summary(spec) == _summary(plain)
    assert engine.proposer.counts.accepted_tokens > 0


def test_stop_string_inside_a_step_of_several_tokens(paged_model, tiny_tokenizer):
    plain, _ = _chunks(paged_model, tiny_tokenizer, None)
    text = "".join(c.text for c in plain)
    stop = text[len(text) * 2 // 3 :][:3]  # late in the answer: reached by proposals, if anywhere
    assert stop.strip(), text
    expected, _ = _chunks(paged_model, tiny_tokenizer, None, stop=(stop,))
    spec, engine = _chunks(paged_model, tiny_tokenizer, NGRAM, stop=(stop,))
    assert _summary(spec) == _summary(expected)
    assert spec[-1].finish_reason == "stop"
    assert engine.proposer.counts.accepted_tokens > 0
