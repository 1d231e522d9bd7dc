"""AsyncEngine: the engine on its own thread behind asyncio streams: built and stepped on
one thread, concurrent streams, synchronous refusals, a dead or hung engine thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.support.engines import (
    QueuedEvents,
    chat_request,
    generate,
    greedy,
    make_engine,
    prompt_ids,
    reference_greedy,
    template_ids,
    with_async_engine,
)
from workers.core.limits import CapacityError
from workers.core.sequence import FinishReason
from workers.engine.llm_engine import LLMEngine
from workers.serving.async_engine import AsyncEngine, EngineDeadError
from workers.serving.request_processor import RequestProcessor


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return prompt_ids(tiny_tokenizer)


def test_engine_built_on_its_own_thread_steps_there(tiny_model, paged_model, prompts):
    """The thread that builds the engine (loads the model) is the one that runs its model
    steps: torch's OpenMP pools are per thread (AsyncEngine.start_on_own_thread)."""
    threads: dict[str, int] = {}

    def build() -> LLMEngine:
        threads["build"] = threading.get_ident()
        return make_engine(paged_model)

    def record_forward(*_):
        threads.setdefault("forward", threading.get_ident())

    hook = paged_model.register_forward_pre_hook(record_forward)

    async def main():
        aengine = AsyncEngine.start_on_own_thread(build, asyncio.get_running_loop())
        try:
            events = [e async for batch in QueuedEvents(aengine.add_request(prompts[0], greedy(5))) for e in batch]
        finally:
            aengine.stop()
        return aengine, events

    try:
        aengine, events = asyncio.run(main())
    finally:
        hook.remove()
    assert [e.token_id for e in events] == reference_greedy(tiny_model, prompts[0], 5)
    assert threads["forward"] == threads["build"] != threading.get_ident()
    assert not aengine._thread.is_alive()


def test_engine_build_failure_is_raised_to_the_caller():
    def build() -> LLMEngine:
        raise ValueError("no such model")

    async def main():
        AsyncEngine.start_on_own_thread(build, asyncio.get_running_loop())

    with pytest.raises(ValueError, match="no such model"):
        asyncio.run(main())


def test_async_engine_concurrent_streams(tiny_model, paged_model, prompts):
    engine = make_engine(paged_model, max_num_batched_tokens=16)
    max_tokens = 24

    async def consume(stream):
        batches = []
        async for events in stream:
            batches.append(events)
        return batches

    async def body(aengine):
        streams = [QueuedEvents(aengine.add_request(p, greedy(max_tokens))) for p in prompts]
        return await asyncio.gather(*(consume(s) for s in streams))

    results = asyncio.run(with_async_engine(engine, body))
    for prompt, batches in zip(prompts, results):
        tokens = [e.token_id for batch in batches for e in batch]
        assert tokens == reference_greedy(tiny_model, prompt, max_tokens)
        reasons = [e.finish_reason for batch in batches for e in batch]
        assert reasons == [None] * (max_tokens - 1) + [FinishReason.LENGTH]
    # Tokens arrived as a stream, not in one piece at the end.
    assert max(len(batches) for batches in results) > 1
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_async_engine_rejects_oversized_request_synchronously(paged_model):
    engine = make_engine(paged_model, max_model_len=16)

    async def body(aengine):
        with pytest.raises(CapacityError):
            aengine.add_request(list(range(5, 15)), greedy(7))
        stream = QueuedEvents(aengine.add_request(list(range(5, 15)), greedy(6)))
        return [e async for batch in stream for e in batch]

    events = asyncio.run(with_async_engine(engine, body))
    assert len(events) == 6


def test_engine_thread_failure_fails_every_stream(paged_model, tiny_tokenizer):
    """A request added while the fatal step runs must fail too, not wait forever."""
    engine = make_engine(paged_model)
    in_step = threading.Event()
    release = threading.Event()

    def failing_step():
        in_step.set()
        release.wait(5)
        raise RuntimeError("device lost")

    engine.step = failing_step

    async def body(aengine):
        running = QueuedEvents(aengine.add_request([5, 6, 7], greedy(4)))
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 5)
        # Added while the failing step runs: the engine still looks alive.
        assert aengine.alive
        late = QueuedEvents(aengine.add_request([5, 6, 7, 8], greedy(4)))
        release.set()
        for stream in (running, late):  # neither may hang
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(stream.next_batch(), timeout=5)
        assert not aengine.alive
        with pytest.raises(EngineDeadError):
            aengine.add_request([5], greedy(1))
        processor = RequestProcessor(aengine, tiny_tokenizer)
        chunks = [c async for c in generate(processor, chat_request("hi", 2))]
        assert [c.error.code for c in chunks] == ["engine_dead"] and chunks[0].error.status == 503

    asyncio.run(with_async_engine(engine, body))


def test_a_hung_step_is_visible_to_the_health_check(paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, max_model_len=256)
    release = threading.Event()
    step = engine.step

    def hanging_step():
        release.wait(5)
        return step()

    engine.step = hanging_step

    async def body(aengine):
        stream = QueuedEvents(aengine.add_request(template_ids(tiny_tokenizer, "Hi"), greedy(2)))
        await asyncio.sleep(0.3)
        stuck = aengine.stuck_for()
        release.set()
        # The last step's events are handed over after its clock is cleared, so the
        # request's end is the moment to read it (its stats change inside the step).
        async for _ in stream:
            pass
        return stuck, aengine.stuck_for()

    stuck, after = asyncio.run(with_async_engine(engine, body))
    assert stuck >= 0.25  # the deployment's check_health fails past engine.step_hang_timeout_s
    assert after == 0.0
