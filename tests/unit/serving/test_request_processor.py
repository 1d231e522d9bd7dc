"""RequestProcessor: one request end to end on the worker (prompt -> engine -> chunks):
usage and text, the stream interval, stop strings, errors and timeouts, aborts, cached
tokens, long prompts built off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from tests.support.engines import (
    chat_request,
    generate,
    make_engine,
    reference_greedy,
    template_ids,
    wait_idle,
    with_async_engine,
)
from workers.core.sequence import FinishReason
from workers.engine.llm_engine import LLMEngine
from workers.serving.request_processor import RequestProcessor, Timeouts


def test_request_processor_usage_and_text(tiny_model, paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, max_model_len=256)
    text = "Hi there, what is the capital of France?"

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        return [c async for c in generate(processor, chat_request(text, 9, ignore_eos=True))]

    chunks = asyncio.run(with_async_engine(engine, body))
    prompt_ids = template_ids(tiny_tokenizer, text)
    assert all(c.error is None for c in chunks)
    token_ids = [t for c in chunks for t in c.token_ids]
    assert token_ids == reference_greedy(tiny_model, prompt_ids, 9)
    assert all(c.prompt_tokens == len(prompt_ids) for c in chunks)
    assert chunks[-1].completion_tokens == len(token_ids) == 9
    assert [c.completion_tokens for c in chunks] == sorted(c.completion_tokens for c in chunks)
    assert chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == tiny_tokenizer.decode(token_ids, skip_special_tokens=True)
    assert chunks[0].prefill_time_ms is not None
    assert sum(len(c.decode_times_ms) for c in chunks) == 8
    assert engine.blocks.num_used_blocks == 0


def test_stream_interval_batches_tokens_after_the_first(paged_model, tiny_tokenizer):
    """With stream_interval 3 the first token still goes out alone and at once; later
    chunks carry at least 3 tokens (more when the consumer lags), the last the remainder;
    the tokens, text and usage equal the token-by-token stream's."""
    text = "Hi there, what is the capital of France?"

    def run(interval: int, **params):
        async def body(aengine):
            processor = RequestProcessor(aengine, tiny_tokenizer, stream_interval=interval)
            chunks = [c async for c in generate(processor, chat_request(text, 11, ignore_eos=True, **params))]
            await wait_idle(aengine)
            return chunks

        engine = make_engine(paged_model, max_model_len=256)
        chunks = asyncio.run(with_async_engine(engine, body))
        assert engine.blocks.num_used_blocks == 0 and engine.num_active == 0
        return chunks

    one, three = run(1), run(3)
    assert [t for c in three for t in c.token_ids] == [t for c in one for t in c.token_ids]
    assert "".join(c.text for c in three) == "".join(c.text for c in one)
    assert len(three[0].token_ids) == 1 and three[0].prefill_time_ms is not None
    assert all(len(c.token_ids) >= 3 for c in three[1:-1])
    assert len(three) <= 1 + -(-10 // 3)
    assert three[-1].finish_reason == "length" and three[-1].completion_tokens == 11
    assert sum(len(c.decode_times_ms) for c in three) == 10
    # n = 2: the interval counts per choice; each choice's tokens equal the unbatched stream's.
    two = run(3, n=2)
    by_choice = {i: [t for c in two if c.index == i for t in c.token_ids] for i in (0, 1)}
    assert [len(v) for v in by_choice.values()] == [11, 11]
    unbatched = run(1, n=2)
    assert by_choice == {i: [t for c in unbatched if c.index == i for t in c.token_ids] for i in (0, 1)}


def test_a_failure_goes_out_at_once_after_the_tokens_before_it(paged_model, tiny_tokenizer):
    """With a stream interval of 8, a request whose fourth step fails still gets its first
    three tokens, then the error, without waiting for the interval to fill."""
    engine = make_engine(paged_model, max_model_len=256)
    sampler, calls = engine.sampler, [0]

    def failing_from_the_fourth_call(logits, tensors):
        calls[0] += 1
        if calls[0] >= 4:  # also the engine's one-at-a-time retry of the failed step
            raise RuntimeError("injected sampling failure")
        return sampler(logits, tensors)

    engine.sampler = failing_from_the_fourth_call

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer, stream_interval=8)
        chunks = [c async for c in generate(processor, chat_request("Hi there", 20, ignore_eos=True))]
        await wait_idle(aengine)
        return chunks

    chunks = asyncio.run(with_async_engine(engine, body))
    assert chunks[-1].error is not None and chunks[-1].error.code == "engine_error"
    assert all(c.error is None for c in chunks[:-1])
    assert sum(len(c.token_ids) for c in chunks) == 3
    assert engine.blocks.num_used_blocks == 0 and engine.num_active == 0


def test_request_processor_stop_string_ends_request(paged_model, tiny_tokenizer):
    text = "Tell me about Paris."

    async def body(aengine, request):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        chunks = [c async for c in generate(processor, request)]
        await wait_idle(aengine)
        return chunks

    engine = make_engine(paged_model, max_model_len=256)
    full = asyncio.run(with_async_engine(engine, lambda a: body(a, chat_request(text, 24, ignore_eos=True))))
    full_text = "".join(c.text for c in full)
    visible = [ch for ch in full_text[4:] if ch != "\ufffd" and ch.strip()]
    assert visible, f"no usable stop string in {full_text!r}"
    stop = visible[0]
    expected = full_text[: full_text.index(stop)]

    engine = make_engine(paged_model, max_model_len=256)
    request = chat_request(text, 24, ignore_eos=True, stop=(stop,))
    chunks = asyncio.run(with_async_engine(engine, lambda a: body(a, request)))
    assert "".join(c.text for c in chunks) == expected
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == stop
    assert chunks[-1].completion_tokens < 24
    assert engine.blocks.num_used_blocks == 0 and engine.num_active == 0


@pytest.mark.parametrize(("text", "max_tokens", "param"), [
    ("a long message " * 10, 4, "messages"),  # the prompt alone does not fit
    ("hi", 40, "max_tokens"),  # the prompt fits; the answer asked for does not
])
def test_request_processor_context_length_error(paged_model, tiny_tokenizer, text, max_tokens, param):
    engine = make_engine(paged_model, max_model_len=24)

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        return [c async for c in generate(processor, chat_request(text, max_tokens))]

    chunks = asyncio.run(with_async_engine(engine, body))
    assert len(chunks) == 1
    err = chunks[0].error
    assert err is not None and err.status == 400 and err.code == "context_length_exceeded"
    assert err.param == param


def test_aborted_request_leaves_no_used_blocks(paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, num_blocks=256, max_model_len=512)
    aborted = []
    scheduler_abort = engine.scheduler.abort

    def recording_abort(seq):
        scheduler_abort(seq)
        aborted.append((seq, seq.finish_reason))

    engine.scheduler.abort = recording_abort

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        gen = generate(processor, chat_request("Hello!", 400, ignore_eos=True))
        received = 0
        async for chunk in gen:
            received += len(chunk.token_ids)
            if received >= 2:
                break
        await gen.aclose()
        await wait_idle(engine)
        return received

    received = asyncio.run(with_async_engine(engine, body))
    assert received >= 2
    assert engine.blocks.num_used_blocks == 0
    assert engine.num_active == 0
    assert len(aborted) == 1
    seq, reason = aborted[0]
    assert reason is FinishReason.ABORT
    assert seq.num_output_tokens < 400


def _slow_steps(engine: LLMEngine, seconds: float) -> None:
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step = slow_step


def _generate_with_timeouts(engine: LLMEngine, tokenizer, timeouts: Timeouts, max_tokens: int) -> list:
    async def body(aengine):
        processor = RequestProcessor(aengine, tokenizer, timeouts)
        chunks = [c async for c in generate(processor, chat_request("Hi", max_tokens, ignore_eos=True))]
        await wait_idle(aengine)
        return chunks

    return asyncio.run(with_async_engine(engine, body))


def test_first_token_timeout_ends_the_request_and_frees_its_cache(paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, max_model_len=256)
    _slow_steps(engine, 0.3)
    chunks = _generate_with_timeouts(engine, tiny_tokenizer, Timeouts(first_token_s=0.05), 5)
    assert len(chunks) == 1 and chunks[0].error is not None
    assert (chunks[0].error.status, chunks[0].error.code) == (504, "first_token_timeout")
    assert engine.blocks.num_used_blocks == 0 and engine.num_active == 0


def test_request_timeout_cuts_a_long_request(paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, max_model_len=256)
    _slow_steps(engine, 0.01)
    chunks = _generate_with_timeouts(engine, tiny_tokenizer, Timeouts(request_s=0.3), 200)
    assert chunks[-1].error is not None and chunks[-1].error.code == "request_timeout"
    assert 0 < sum(len(c.token_ids) for c in chunks[:-1]) < 200  # some tokens came before the cut
    assert engine.blocks.num_used_blocks == 0 and engine.num_active == 0


def test_request_processor_puts_cached_tokens_on_every_chunk_from_the_first(paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, max_model_len=256)
    text = "Paris is the capital of France. Berlin is the capital of Germany. Rome is"

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        runs = []
        for params in ({}, {}, {"n": 2, "temperature": 1.0, "seed": 5}):
            request = chat_request(text, 4, ignore_eos=True)
            request = dataclasses.replace(request, params=dataclasses.replace(request.params, **params))
            runs.append([c async for c in generate(processor, request)])
        return runs

    first, second, forked = asyncio.run(with_async_engine(engine, body))
    prompt_len = len(template_ids(tiny_tokenizer, text))
    assert {c.cached_tokens for c in first} == {0}
    assert {c.cached_tokens for c in second} == {prompt_len - 1}  # all but the last token
    assert {(c.index, c.cached_tokens) for c in forked} == {(0, prompt_len - 1), (1, prompt_len - 1)}


def test_long_prompts_are_built_off_the_event_loop(paged_model, tiny_tokenizer, monkeypatch):
    from workers.serving import request_processor as rp

    threaded = []
    real = asyncio.to_thread

    async def recording_to_thread(func, *args):
        threaded.append(getattr(func, "__name__", func))
        return await real(func, *args)

    monkeypatch.setattr(rp.asyncio, "to_thread", recording_to_thread)
    engine = make_engine(paged_model, max_model_len=64)

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        short = [c async for c in generate(processor, chat_request("hi", 2))]
        long = [c async for c in generate(processor, chat_request("x" * (rp.INLINE_PROMPT_BYTES + 1), 2))]
        return short, long

    short, long = asyncio.run(with_async_engine(engine, body))
    assert short[-1].finish_reason == "length"
    assert long[-1].error.code == "context_length_exceeded"  # built (in a thread), then refused
    assert threaded == ["build"]
