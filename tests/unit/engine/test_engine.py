"""The engine end to end on the tiny model: batched greedy == transformers generate,
preemption, abort, finish reasons, and the asyncio side (AsyncEngine, RequestProcessor)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from tests.support.engines import (
    chat_request,
    greedy,
    make_engine,
    record_preemptions,
    reference_greedy,
    run_to_completion,
    template_ids,
    wait_idle,
    with_async_engine,
)
from workers.contract.sampling_params import SamplingParams
from workers.engine.limits import CapacityError
from workers.engine.llm_engine import LLMEngine
from workers.engine.sequence import FinishReason
from workers.serving.async_engine import AsyncEngine, EngineDeadError
from workers.serving.request_processor import RequestProcessor

PROMPT_TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is",
    "def add(a, b):\n    return",
    "Unicode: café naïve 你好 世界 😀 — emoji and accents, numbers 0 1 2 3 4 5 6 7 8 9",
]


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    ids = [tiny_tokenizer(t)["input_ids"] for t in PROMPT_TEXTS]
    assert len({len(p) for p in ids}) == len(ids)  # all different lengths
    return ids


@pytest.mark.parametrize(
    "limits",
    [
        dict(block_size=4),
        dict(block_size=4, max_num_batched_tokens=8),  # prompts chunked over steps
        dict(block_size=16, max_num_batched_tokens=5, max_num_seqs=2),
        dict(block_size=1, max_num_batched_tokens=3),
    ],
    ids=["roomy", "chunked", "chunked-2seqs", "block1"],
)
def test_batched_greedy_equals_generate(tiny_model, paged_model, prompts, limits):
    engine = make_engine(paged_model, num_blocks=400 // limits["block_size"] * 4, **limits)
    ids = [engine.add_request(p, greedy(10)) for p in prompts]
    events = run_to_completion(engine)
    for seq_id, prompt in zip(ids, prompts):
        tokens = [e.token_id for e in events[seq_id]]
        assert tokens == reference_greedy(tiny_model, prompt, 10)
        assert [e.finish_reason for e in events[seq_id]] == [None] * 9 + [FinishReason.LENGTH]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.num_active == 0


def test_request_added_mid_generation_joins_the_batch(tiny_model, paged_model, prompts):
    engine = make_engine(paged_model, max_num_batched_tokens=6)
    first = engine.add_request(prompts[2], greedy(12))
    events: dict[int, list[int]] = {}
    for _ in range(5):
        for ev in engine.step():
            events.setdefault(ev.request_id, []).append(ev.token_id)
    second = engine.add_request(prompts[4], greedy(12))
    for seq_id, evs in run_to_completion(engine).items():
        events.setdefault(seq_id, []).extend(e.token_id for e in evs)
    assert events[first] == reference_greedy(tiny_model, prompts[2], 12)
    assert events[second] == reference_greedy(tiny_model, prompts[4], 12)


def test_preemption_recomputes_same_greedy_tokens(tiny_model, paged_model, prompts):
    max_tokens = 12
    longest = max(len(p) for p in prompts) + max_tokens
    num_blocks = -(-longest // 4) + 1  # enough for one sequence at a time, not for all
    small = make_engine(paged_model, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16)
    preempted = record_preemptions(small)
    ids = [small.add_request(p, greedy(max_tokens)) for p in prompts]
    events = run_to_completion(small)
    assert len(preempted) > 0, "the pool was meant to force preemption"

    large = make_engine(paged_model, num_blocks=256)
    large_ids = [large.add_request(p, greedy(max_tokens)) for p in prompts]
    large_events = run_to_completion(large)
    for seq_id, large_id, prompt in zip(ids, large_ids, prompts):
        tokens = [e.token_id for e in events[seq_id]]
        assert tokens == [e.token_id for e in large_events[large_id]]
        assert tokens == reference_greedy(tiny_model, prompt, max_tokens)
    assert small.blocks.num_free_blocks == num_blocks


def test_seeded_sampling_independent_of_batch_and_preemption(paged_model, prompts):
    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=1.5, top_p=0.95, seed=seed, ignore_eos=True)

    alone = make_engine(paged_model, num_blocks=256)
    alone_id = alone.add_request(prompts[2], seeded(7))
    alone_tokens = [e.token_id for e in run_to_completion(alone)[alone_id]]

    # Same request in a crowded, preempting engine, with unseeded neighbours.
    longest = max(len(p) for p in prompts) + 12
    crowded = make_engine(paged_model, num_blocks=-(-longest // 4) + 1, max_num_batched_tokens=16)
    preempted = record_preemptions(crowded)
    ids = [crowded.add_request(p, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)) for p in prompts]
    seeded_id = crowded.add_request(prompts[2], seeded(7))
    other_seed = crowded.add_request(prompts[2], seeded(8))
    events = run_to_completion(crowded)
    assert preempted
    assert set(events) == set(ids) | {seeded_id, other_seed}
    assert [e.token_id for e in events[seeded_id]] == alone_tokens
    assert [e.token_id for e in events[other_seed]] != alone_tokens


def test_abort_mid_generation_frees_all_blocks(paged_model, prompts):
    engine = make_engine(paged_model, num_blocks=64)
    ids = [engine.add_request(p, greedy(50)) for p in prompts]
    for _ in range(4):
        engine.step()
    assert engine.blocks.num_used_blocks > 0
    engine.abort_request(ids[0])
    engine.abort_request(ids[3])
    engine.abort_request(12345)  # unknown ids are ignored
    assert engine.num_active == len(prompts) - 2
    seen = set()
    for _ in range(3):
        seen |= {ev.request_id for ev in engine.step()}
    assert ids[0] not in seen and ids[3] not in seen
    assert {ids[1], ids[2], ids[4]} <= seen
    for seq_id in ids:
        engine.abort_request(seq_id)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.has_work() and engine.num_active == 0
    assert engine.step() == []


def test_abort_of_waiting_request(paged_model, prompts):
    engine = make_engine(paged_model, num_blocks=64, max_num_seqs=1)
    a = engine.add_request(prompts[1], greedy(20))
    b = engine.add_request(prompts[2], greedy(20))
    engine.step()
    engine.abort_request(b)  # never ran
    events = run_to_completion(engine)
    assert set(events) == {a}
    assert engine.blocks.num_free_blocks == 64


def test_max_tokens_finishes_with_length(paged_model, prompts):
    engine = make_engine(paged_model)
    seq_id = engine.add_request(prompts[1], greedy(3))
    evs = run_to_completion(engine)[seq_id]
    assert len(evs) == 3
    assert evs[-1].finish_reason is FinishReason.LENGTH and evs[-1].finish_reason.value == "length"


def test_eos_finishes_with_stop(tiny_model, paged_model, prompts):
    ref = reference_greedy(tiny_model, prompts[1], 10)
    eos = ref[3]
    cut = ref.index(eos)  # first occurrence
    engine = make_engine(paged_model, eos=frozenset({eos}))
    seq_id = engine.add_request(prompts[1], SamplingParams(max_tokens=10, temperature=0.0))
    ignoring = engine.add_request(prompts[1], greedy(10))  # ignore_eos=True
    events = run_to_completion(engine)
    evs = events[seq_id]
    assert [e.token_id for e in evs] == ref[: cut + 1]
    assert evs[-1].finish_reason is FinishReason.STOP and evs[-1].finish_reason.value == "stop"
    assert evs[-1].stop_token_id is None  # EOS, not a requested stop token
    assert [e.token_id for e in events[ignoring]] == ref


def test_stop_token_ids_finish_with_stop(tiny_model, paged_model, prompts):
    ref = reference_greedy(tiny_model, prompts[2], 10)
    stop = ref[2]
    cut = ref.index(stop)
    engine = make_engine(paged_model)
    seq_id = engine.add_request(prompts[2], greedy(10, stop_token_ids=(stop,)))
    evs = run_to_completion(engine)[seq_id]
    assert [e.token_id for e in evs] == ref[: cut + 1]
    assert evs[-1].finish_reason is FinishReason.STOP
    assert evs[-1].stop_token_id == stop


def test_context_window_cap_raises_capacity_error(paged_model):
    engine = make_engine(paged_model, num_blocks=64, max_model_len=32)
    prompt = list(range(5, 25))  # 20 tokens
    engine.add_request(prompt, greedy(12))  # exactly 32: fits
    with pytest.raises(CapacityError, match="maximum context length is 32"):
        engine.add_request(prompt, greedy(13))
    with pytest.raises(CapacityError):
        engine.add_request(list(range(5, 40)), greedy(1))
    assert engine.num_active == 1


def test_request_larger_than_kv_pool_raises_capacity_error(paged_model):
    engine = make_engine(paged_model, num_blocks=4, block_size=4)  # 16 token slots
    engine.add_request(list(range(5, 15)), greedy(6))
    with pytest.raises(CapacityError, match="KV cache"):
        engine.add_request(list(range(5, 15)), greedy(7))


# --- asyncio side -------------------------------------------------------------------


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
            events = [e async for batch in aengine.add_request(prompts[0], greedy(5)) for e in batch]
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
        streams = [aengine.add_request(p, greedy(max_tokens)) for p in prompts]
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
        stream = aengine.add_request(list(range(5, 15)), greedy(6))
        return [e async for batch in stream for e in batch]

    events = asyncio.run(with_async_engine(engine, body))
    assert len(events) == 6


def test_request_processor_usage_and_text(tiny_model, paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, max_model_len=256)
    text = "Hi there, what is the capital of France?"

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        return [c async for c in processor.generate(chat_request(text, 9, ignore_eos=True))]

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
            chunks = [c async for c in processor.generate(chat_request(text, 11, ignore_eos=True, **params))]
            await wait_idle(aengine.engine)
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
        chunks = [c async for c in processor.generate(chat_request("Hi there", 20, ignore_eos=True))]
        await wait_idle(aengine.engine)
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
        chunks = [c async for c in processor.generate(request)]
        await wait_idle(aengine.engine)
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
        return [c async for c in processor.generate(chat_request(text, max_tokens))]

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
        gen = processor.generate(chat_request("Hello!", 400, ignore_eos=True))
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
        running = aengine.add_request([5, 6, 7], greedy(4))
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 5)
        # Added while the failing step runs: the engine still looks alive.
        assert aengine.alive
        late = aengine.add_request([5, 6, 7, 8], greedy(4))
        release.set()
        for stream in (running, late):  # neither may hang
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(stream.next_batch(), timeout=5)
        assert not aengine.alive
        with pytest.raises(EngineDeadError):
            aengine.add_request([5], greedy(1))
        processor = RequestProcessor(aengine, tiny_tokenizer)
        chunks = [c async for c in processor.generate(chat_request("hi", 2))]
        assert [c.error.code for c in chunks] == ["engine_dead"] and chunks[0].error.status == 503

    asyncio.run(with_async_engine(engine, body))


def _slow_steps(engine: LLMEngine, seconds: float) -> None:
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step = slow_step


def test_first_token_timeout_ends_the_request_and_frees_its_cache(paged_model, tiny_tokenizer):
    from workers.serving.request_processor import Timeouts

    engine = make_engine(paged_model, max_model_len=256)
    _slow_steps(engine, 0.3)

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer, Timeouts(first_token_s=0.05))
        chunks = [c async for c in processor.generate(chat_request("Hi", 5, ignore_eos=True))]
        await wait_idle(aengine.engine)
        return chunks

    chunks = asyncio.run(with_async_engine(engine, body))
    assert len(chunks) == 1 and chunks[0].error is not None
    assert (chunks[0].error.status, chunks[0].error.code) == (504, "first_token_timeout")
    assert engine.blocks.num_used_blocks == 0 and engine.num_active == 0


def test_request_timeout_cuts_a_long_request(paged_model, tiny_tokenizer):
    from workers.serving.request_processor import Timeouts

    engine = make_engine(paged_model, max_model_len=256)
    _slow_steps(engine, 0.01)

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer, Timeouts(request_s=0.3))
        chunks = [c async for c in processor.generate(chat_request("Hi", 200, ignore_eos=True))]
        await wait_idle(aengine.engine)
        return chunks

    chunks = asyncio.run(with_async_engine(engine, body))
    assert chunks[-1].error is not None and chunks[-1].error.code == "request_timeout"
    assert 0 < sum(len(c.token_ids) for c in chunks[:-1]) < 200  # some tokens came before the cut
    assert engine.blocks.num_used_blocks == 0 and engine.num_active == 0


def test_a_hung_step_is_visible_to_the_health_check(paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, max_model_len=256)
    release = threading.Event()
    step = engine.step

    def hanging_step():
        release.wait(5)
        return step()

    engine.step = hanging_step

    async def body(aengine):
        aengine.add_request(template_ids(tiny_tokenizer, "Hi"), greedy(2))
        await asyncio.sleep(0.3)
        stuck = aengine.stuck_for()
        release.set()
        await wait_idle(aengine.engine)
        return stuck, aengine.stuck_for()

    stuck, after = asyncio.run(with_async_engine(engine, body))
    assert stuck >= 0.25  # the deployment's check_health fails past engine.step_hang_timeout_s
    assert after == 0.0


def test_worker_health_check_fails_on_a_hung_or_dead_engine(tiny_model_dir):
    from workers.serving.deployment import ModelWorker

    config = {"id": "tiny", "source": str(tiny_model_dir),
              "engine": {"kv_cache_memory_gib": 0.001, "step_hang_timeout_s": 5, "torch_threads": 1}}

    async def body():
        worker = ModelWorker.func_or_class(config)
        try:
            worker.check_health()  # healthy
            worker.engine.stuck_for = lambda: 6.0
            with pytest.raises(RuntimeError, match="hung"):
                worker.check_health()
            worker.engine.stuck_for = lambda: 0.0
            worker.engine.error = RuntimeError("boom")
            with pytest.raises(RuntimeError, match="not running"):
                worker.check_health()
        finally:
            worker.engine.error = None
            worker.engine.stop()

    asyncio.run(body())


def test_an_exception_in_one_requests_sampling_fails_that_request_only(paged_model, tiny_tokenizer):
    """The step is undone and its requests re-run one at a time: only the poisoned one fails,
    the others finish with exactly the tokens they get without it."""
    prompts = [template_ids(tiny_tokenizer, t) for t in ("Hello there", "Paris is", "def add(a, b):")]
    clean = make_engine(paged_model)
    ids = [clean.add_request(p, greedy(8)) for p in prompts]
    expected = run_to_completion(clean)

    engine = make_engine(paged_model)
    sampler = engine.sampler
    poison_seed = 666

    def poisoned_sampler(logits, tensors):
        if tensors.generators:  # the (only) seeded request is in this step
            raise RuntimeError("injected sampling failure")
        return sampler(logits, tensors)

    engine.sampler = poisoned_sampler
    good = [engine.add_request(p, greedy(8)) for p in prompts]
    bad = engine.add_request(prompts[0], SamplingParams(max_tokens=8, temperature=1.0, seed=poison_seed))
    events = run_to_completion(engine)
    assert [e.error is not None for e in events[bad]] == [True]
    assert events[bad][0].request_finished
    for rid, ref in zip(good, ids):
        assert [e.token_id for e in events[rid]] == [e.token_id for e in expected[ref]]
    assert engine.blocks.num_used_blocks == 0 and engine.scheduler.only_request is None


def test_queue_time_is_reported_once_per_request(paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, max_num_seqs=1)  # the second request must wait for the first
    first = engine.add_request(template_ids(tiny_tokenizer, "Hi"), greedy(6))
    second = engine.add_request(template_ids(tiny_tokenizer, "Hello"), greedy(2))
    events = run_to_completion(engine)
    for rid in (first, second):
        assert events[rid][0].queue_time is not None and events[rid][0].queue_time >= 0
        assert all(e.queue_time is None for e in events[rid][1:])
    assert events[second][0].queue_time > events[first][0].queue_time  # waited for six steps


# --- prefix cache -------------------------------------------------------------------------


def count_fed_tokens(engine: LLMEngine) -> list[int]:
    """Tokens fed to the model, one entry per forward call (a pre-hook on the model)."""
    fed: list[int] = []

    def hook(module, args, kwargs):
        fed.append(kwargs["input_ids"].shape[-1])

    engine.runner.model.register_forward_pre_hook(hook, with_kwargs=True)
    return fed


def shared_prefix_prompts(tiny_tokenizer) -> tuple[list[int], list[list[int]]]:
    system = tiny_tokenizer("You are a helpful assistant. " * 4)["input_ids"]
    questions = ["Paris is the capital of", "def add(a, b):", "The quick brown fox", "Hello! How can I"]
    return system, [system + tiny_tokenizer(q)["input_ids"] for q in questions]


def run_in_waves(engine: LLMEngine, waves: list[list[tuple[list[int], SamplingParams]]]) -> list[list]:
    """Each wave is added after the previous one finished (so later waves can hit the cache)."""
    out = []
    for wave in waves:
        ids = [engine.add_request(p, params) for p, params in wave]
        events = run_to_completion(engine)
        out.extend(events[i] for i in ids)
    return out


def test_outputs_identical_with_prefix_cache_on_and_off(paged_model, tiny_tokenizer):
    system, prompts = shared_prefix_prompts(tiny_tokenizer)
    whole_blocks = prompts[2][: len(prompts[2]) // 4 * 4]  # a prompt that ends on a block boundary
    seeded_n = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True)
    waves = [
        [(prompts[0], greedy(8)), (whole_blocks, greedy(8))],
        [(prompts[1], greedy(8)), (prompts[2], seeded_n)],  # n > 1 forks after a cache hit
        [(prompts[0], greedy(8)), (whole_blocks, greedy(8)), (prompts[3], greedy(8, logprobs=2)),
         (prompts[1], greedy(8, prompt_logprobs=2))],
    ]
    results = {}
    for enabled in (False, True):
        engine = make_engine(paged_model, num_blocks=128, enable_prefix_caching=enabled)
        results[enabled] = run_in_waves(engine, waves)
        assert engine.blocks.num_used_blocks == 0
    for off, on in zip(results[False], results[True]):
        assert [(e.index, e.token_id) for e in off] == [(e.index, e.token_id) for e in on]
        assert [e.logprob for e in off] == pytest.approx([e.logprob for e in on], abs=1e-4)
        assert off[0].cached_tokens == 0
    cached = [evs[0].cached_tokens for evs in results[True]]
    shared = len(system) // 4 * 4
    assert cached[:2] == [0, 0]
    assert cached[2] >= shared and cached[3] >= shared  # the shared system prompt, whole blocks
    assert cached[4] == (len(prompts[0]) - 1) // 4 * 4  # the same prompt again: all its full blocks
    assert cached[5] == len(whole_blocks) - 4  # ... but the last token is always computed
    assert cached[6] >= shared
    assert cached[7] == 0  # prompt_logprobs skips the cache
    prompt_lp = {on: results[on][7][0].prompt_logprobs for on in (False, True)}
    assert len(prompt_lp[True]) == len(prompts[1]) - 1
    assert [t for t, *_ in prompt_lp[True]] == [t for t, *_ in prompt_lp[False]]


def test_second_request_with_shared_prefix_feeds_fewer_tokens(paged_model, tiny_tokenizer):
    system, prompts = shared_prefix_prompts(tiny_tokenizer)
    fed_per_request = {}
    for enabled in (False, True):
        engine = make_engine(paged_model, num_blocks=128, enable_prefix_caching=enabled)
        run_in_waves(engine, [[(prompts[0], greedy(1))]])
        fed = count_fed_tokens(engine)
        (events,) = run_in_waves(engine, [[(prompts[1], greedy(1))]])
        fed_per_request[enabled] = sum(fed)
        assert events[0].cached_tokens == (len(system) // 4 * 4 if enabled else 0)
    assert fed_per_request[False] == len(prompts[1])
    assert fed_per_request[True] == len(prompts[1]) - len(system) // 4 * 4


def test_preemption_resumes_from_the_cache_with_identical_greedy_output(tiny_model, paged_model, prompts):
    max_tokens = 12
    longest = max(len(p) for p in prompts) + max_tokens
    engine = make_engine(paged_model, num_blocks=-(-longest // 4) + 2, block_size=4, max_num_batched_tokens=16)
    resumed_at: list[int] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        resumed_at.extend(c.seq.num_computed_tokens for c in batch.prefills if c.seq.num_output_tokens > 0)
        return batch

    engine.scheduler.schedule = recording_schedule
    ids = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
    events = run_to_completion(engine)
    assert resumed_at and max(resumed_at) > 0, "a preempted sequence should resume from its cached blocks"
    for rid, prompt in zip(ids, prompts):
        assert [e.token_id for e in events[rid]] == reference_greedy(tiny_model, prompt, max_tokens)
    assert engine.blocks.num_used_blocks == 0


def test_beam_search_with_a_cached_prefix_matches_no_cache(paged_model, tiny_tokenizer):
    _, prompts = shared_prefix_prompts(tiny_tokenizer)
    beams = SamplingParams(max_tokens=6, n=2, use_beam_search=True, best_of=3, ignore_eos=True, temperature=0.0)
    results = {}
    for enabled in (False, True):
        engine = make_engine(paged_model, num_blocks=128, enable_prefix_caching=enabled)
        results[enabled] = run_in_waves(engine, [[(prompts[0], greedy(4))], [(prompts[2], beams)]])[1]
    assert [e.beam_token_ids for e in results[True]] == [e.beam_token_ids for e in results[False]]
    assert results[True][0].cached_tokens > 0


def test_a_failed_step_leaves_the_prefix_cache_consistent(paged_model, tiny_tokenizer):
    """Blocks are registered only after the forward pass wrote them: after a step fails and
    is re-run request by request, later requests that hit those blocks get the clean output."""
    _, prompts = shared_prefix_prompts(tiny_tokenizer)
    clean = make_engine(paged_model, num_blocks=128, enable_prefix_caching=False)
    expected = [[e.token_id for e in evs] for evs in run_in_waves(clean, [[(p, greedy(6)) for p in prompts]])]

    engine = make_engine(paged_model, num_blocks=128)
    forward = engine.runner.forward

    def poisoned_forward(decodes, prefills):  # fails before any K/V is written
        if any(c.seq.params.seed is not None for c in decodes + prefills):
            raise RuntimeError("injected model failure")
        return forward(decodes, prefills)

    engine.runner.forward = poisoned_forward
    good = [engine.add_request(p, greedy(6)) for p in prompts[:2]]
    bad = engine.add_request(prompts[2], SamplingParams(max_tokens=6, temperature=1.0, seed=1))
    events = run_to_completion(engine)
    assert events[bad][0].error is not None
    assert [[e.token_id for e in events[r]] for r in good] == expected[:2]
    again = run_in_waves(engine, [[(p, greedy(6)) for p in prompts]])
    assert [evs[0].cached_tokens > 0 for evs in again] == [True] * 4
    assert [[e.token_id for e in evs] for evs in again] == expected
    assert engine.blocks.num_used_blocks == 0


def test_request_processor_puts_cached_tokens_on_every_chunk_from_the_first(paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, max_model_len=256)
    text = "Paris is the capital of France. Berlin is the capital of Germany. Rome is"

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        runs = []
        for params in ({}, {}, {"n": 2, "temperature": 1.0, "seed": 5}):
            request = chat_request(text, 4, ignore_eos=True)
            request = dataclasses.replace(request, params=dataclasses.replace(request.params, **params))
            runs.append([c async for c in processor.generate(request)])
        return runs

    first, second, forked = asyncio.run(with_async_engine(engine, body))
    prompt_len = len(template_ids(tiny_tokenizer, text))
    assert {c.cached_tokens for c in first} == {0}
    assert {c.cached_tokens for c in second} == {(prompt_len - 1) // 4 * 4}
    assert {(c.index, c.cached_tokens) for c in forked} == {(0, (prompt_len - 1) // 4 * 4), (1, (prompt_len - 1) // 4 * 4)}


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
        short = [c async for c in processor.generate(chat_request("hi", 2))]
        long = [c async for c in processor.generate(chat_request("x" * (rp.INLINE_PROMPT_BYTES + 1), 2))]
        return short, long

    short, long = asyncio.run(with_async_engine(engine, body))
    assert short[-1].finish_reason == "length"
    assert long[-1].error.code == "context_length_exceeded"  # built (in a thread), then refused
    assert threaded == ["build"]
