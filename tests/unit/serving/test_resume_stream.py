"""A stream broken after any chunk and resumed on another worker (GenerateRequest.resume)
gives its client exactly the uninterrupted stream: the same text (no character repeated
or lost, also mid multi-byte character and inside a held-back stop string), token ids,
finish reason and usage. On the tiny model, for greedy, seeded, penalised with
min_tokens, stop-string, JSON-schema and n = 2 requests."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import pytest

from tests.support.engines import generate, make_engine, wait_idle, with_async_engine
from workers.contract.chunks import GenerationChunk
from workers.contract.continuation import ChoiceProgress, Continuation
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import GuidedDecoding, SamplingParams
from workers.engine.llm_engine import LLMEngine
from workers.serving.async_engine import AsyncEngine
from workers.serving.request_processor import RequestProcessor

TEXT = "Unicode: café naïve 你好 世界 😀 — tell me more."
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


def chat_request(max_tokens: int, **params) -> GenerateRequest:
    params = {"temperature": 0.0, **params}
    return GenerateRequest("r", SamplingParams(**params), messages=[{"role": "user", "content": TEXT}],
                           max_tokens=max_tokens)


class Lockstep:
    """The engine takes its next step only once the test has read the chunks of the last
    one, so every chunk carries one token per choice and a cut lands after any token."""

    def __init__(self, engine: LLMEngine) -> None:
        self.read = threading.Event()
        self.read.set()
        self.free = False
        step = engine.step

        def gated_step():
            self.read.wait(timeout=30)
            events = step()
            if events and not self.free:
                self.read.clear()
            return events

        engine.step = gated_step

    def release(self) -> None:
        """Run freely from now on (the reader is gone)."""
        self.free = True
        self.read.set()


async def read(processor: RequestProcessor, request: GenerateRequest, gate: Lockstep | None = None,
               cut: int | None = None) -> list[GenerationChunk]:
    """The chunks a client receives; with `cut`, the stream breaks after that many chunks."""
    chunks = []
    stream = generate(processor, request)
    try:
        async for chunk in stream:
            chunks.append(chunk)
            if cut is not None and len(chunks) == cut:
                break
            if gate is not None:
                gate.read.set()
    finally:
        await stream.aclose()  # the worker's generator closes: its request is aborted
        if gate is not None:
            gate.release()
    return chunks


def content(chunk: GenerationChunk) -> tuple:
    """What a chunk says, less its timings and cache hits."""
    return (chunk.index, chunk.text, chunk.token_ids, chunk.finish_reason, chunk.stop_reason,
            chunk.completion_tokens)


def continuation(received: list[GenerationChunk], n: int) -> Continuation:
    """What the ingress builds from the chunks it got: each choice's ids, and whether it ended."""
    return Continuation(tuple(
        ChoiceProgress(tuple(t for c in received if c.index == i for t in c.token_ids),
                       any(c.finish_reason is not None for c in received if c.index == i))
        for i in range(n)))


def per_choice(chunks: list[GenerationChunk], n: int) -> list[tuple[str, list[int], str | None, object]]:
    """Each choice's text, token ids, finish reason and stop reason."""
    out = []
    for i in range(n):
        mine = [c for c in chunks if c.index == i]
        out.append(("".join(c.text for c in mine), [t for c in mine for t in c.token_ids],
                    mine[-1].finish_reason, mine[-1].stop_reason))
    return out


def held_back(chunks: list[GenerationChunk], tokenizer) -> list[int]:
    """Cut points (chunk counts) after which a single choice's client has less text than
    its ids decode to: a partial UTF-8 character or a possible stop string is held."""
    cuts = []
    for k in range(1, len(chunks)):
        ids = [t for c in chunks[:k] for t in c.token_ids]
        if len("".join(c.text for c in chunks[:k])) < len(tokenizer.decode(ids, skip_special_tokens=True)):
            cuts.append(k)
    return cuts


def check_resumes(model, tokenizer, request: GenerateRequest, cuts_of, eos=frozenset()) -> list[GenerationChunk]:
    """Run `request` whole, then for each cut (cuts_of(reference chunks)) break it there on
    one engine and resume it on another; the client's stream must equal the reference."""
    first, second = make_engine(model, eos=eos, tokenizer=tokenizer), make_engine(model, eos=eos, tokenizer=tokenizer)
    gate = Lockstep(first)
    n = request.params.n

    async def body(first_engine: AsyncEngine):
        resumer = AsyncEngine(second)
        resumer.start(asyncio.get_running_loop())
        try:
            worker, other = RequestProcessor(first_engine, tokenizer), RequestProcessor(resumer, tokenizer)
            gate.free = False
            reference = await read(worker, request, gate)
            cuts = cuts_of(reference)
            assert cuts and max(cuts) < len(reference)
            for cut in cuts:
                await wait_idle(first_engine)  # the last run's abort has landed
                gate.free = False
                received = await read(worker, request, gate, cut=cut)
                # Deterministic: the same chunks up to the break.
                assert [content(c) for c in received] == [content(c) for c in reference[:cut]]
                resumed = dataclasses.replace(request, resume=continuation(received, n))
                rest = await read(other, resumed)
                await wait_idle(resumer)  # a stop string's abort lands on the engine thread
                stream = received + rest
                assert all(c.error is None for c in stream)
                assert per_choice(stream, n) == per_choice(reference, n), cut
                assert (stream[-1].prompt_tokens, stream[-1].completion_tokens) == (
                    reference[-1].prompt_tokens, reference[-1].completion_tokens)
                assert all(c.prompt_logprobs is None for c in rest)
                if n == 1:  # the pause is a gap between tokens, not a second time to first token
                    assert rest[0].prefill_time_ms is None and len(rest[0].decode_times_ms) == len(rest[0].token_ids)
            return reference
        finally:
            resumer.stop()

    reference = asyncio.run(with_async_engine(first, body))
    assert second.blocks.num_used_blocks == 0 and second.num_active == 0
    return reference


def spread(chunks: list[GenerationChunk]) -> list[int]:
    n = len(chunks)
    return sorted({1, 2, n // 3, n // 2, n - 1})


def test_greedy_resumes_exactly_also_mid_character(paged_model, tiny_tokenizer):
    mid_character = []

    def cuts(chunks):
        held = held_back(chunks, tiny_tokenizer)  # no stop strings here: partial characters
        mid_character.extend(held)
        return sorted(set(spread(chunks) + held[:4]))

    check_resumes(paged_model, tiny_tokenizer, chat_request(40, ignore_eos=True), cuts)
    assert mid_character  # the random model writes byte tokens of multi-byte characters


def test_seeded_sampling_resumes_exactly(paged_model, tiny_tokenizer):
    request = chat_request(40, ignore_eos=True, temperature=0.8, seed=1234)
    reference = check_resumes(paged_model, tiny_tokenizer, request,
                              lambda chunks: sorted(set(spread(chunks) + held_back(chunks, tiny_tokenizer)[:3])))
    assert reference[-1].finish_reason == "length" and reference[-1].completion_tokens == 40


def test_penalties_and_min_tokens_resume_exactly(paged_model, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    request = chat_request(40, temperature=0.8, seed=5, min_tokens=12, logit_bias={eos: 8.0},
                           frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.2)
    # EOS comes as soon as min_tokens allows: a resumed run that miscounted would differ.
    reference = check_resumes(paged_model, tiny_tokenizer, request, lambda chunks: [3, 11, 12],
                              eos=frozenset({eos}))
    assert reference[-1].finish_reason == "stop" and reference[-1].completion_tokens == 13


def test_stop_strings_resume_exactly_across_the_boundary(paged_model, tiny_tokenizer):
    free = check_resumes(paged_model, tiny_tokenizer, chat_request(30, ignore_eos=True), lambda c: [1])
    text = "".join(c.text for c in free)
    stop = next(text[i:i + 3] for i in range(12, len(text)) if text.find(text[i:i + 3]) == i and
                text[i:i + 3].isprintable())
    request = chat_request(30, ignore_eos=True, stop=(stop, "never appears"))
    reference = check_resumes(paged_model, tiny_tokenizer, request, lambda chunks: list(range(1, len(chunks))))
    assert reference[-1].finish_reason == "stop" and reference[-1].stop_reason == stop
    assert "".join(c.text for c in reference) == text[: text.index(stop)]


def test_json_schema_guided_resumes_exactly(paged_model, tiny_tokenizer):
    guided = GuidedDecoding(kind="json_schema", spec=json.dumps(SCHEMA))
    request = chat_request(96, temperature=1.0, seed=9, guided=guided)
    eos = frozenset({tiny_tokenizer.eos_token_id})
    reference = check_resumes(paged_model, tiny_tokenizer, request, spread, eos=eos)
    assert reference[-1].finish_reason == "stop"
    json.loads("".join(c.text for c in reference))


def test_n_choices_resume_each_from_what_its_client_has(paged_model, tiny_tokenizer):
    request = chat_request(12, ignore_eos=True, temperature=0.9, seed=77, n=2)
    reference = check_resumes(paged_model, tiny_tokenizer, request, lambda chunks: [1, 2, 7, 15, 22, 23])
    texts = per_choice(reference, 2)
    assert texts[0][1] != texts[1][1]


def test_n_choices_one_already_finished(paged_model, tiny_tokenizer):
    """Choice 0 ends early (a stop token): the resumed stream sends choice 1 only, and
    usage still counts choice 0."""
    sampled = {"ignore_eos": True, "n": 2, "temperature": 0.9, "seed": 3}
    probe = per_choice(check_resumes(paged_model, tiny_tokenizer, chat_request(10, **sampled), lambda c: [1]), 2)
    first, second = probe[0][1], probe[1][1]
    stop_id = next(t for p, t in enumerate(first) if p >= 2 and t not in second and t not in first[:p])
    request = chat_request(10, stop_token_ids=(stop_id,), **sampled)

    def after_choice_0_ended(chunks):
        ended = next(k for k, c in enumerate(chunks) if c.index == 0 and c.finish_reason)
        return [ended + 1, ended + 2]

    reference = check_resumes(paged_model, tiny_tokenizer, request, after_choice_0_ended)
    assert per_choice(reference, 2)[0][2] == "stop" and per_choice(reference, 2)[1][2] == "length"


def test_ids_that_end_the_output_finish_at_once(paged_model, tiny_tokenizer):
    """A continuation listing every id of a finished choice (without its end): one last
    chunk, nothing new in it, the right finish reason and usage, and no engine work."""
    engine = make_engine(paged_model)

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        request = chat_request(9, ignore_eos=True)
        reference = await read(processor, request)
        steps = aengine.steps
        ids = tuple(t for c in reference for t in c.token_ids)
        resumed = dataclasses.replace(request, resume=Continuation((ChoiceProgress(ids),)))
        return reference, await read(processor, resumed), aengine.steps - steps

    reference, rest, steps = asyncio.run(with_async_engine(engine, body))
    assert steps == 0
    assert [(c.text, c.token_ids, c.finish_reason, c.completion_tokens) for c in rest] == [("", [], "length", 9)]
    assert reference[-1].completion_tokens == 9


def test_the_first_new_token_goes_out_at_once_whatever_the_stream_interval(paged_model, tiny_tokenizer):
    request = chat_request(16, ignore_eos=True, temperature=0.8, seed=8)

    async def body(aengine):
        reference = await read(RequestProcessor(aengine, tiny_tokenizer), request)
        resumed = dataclasses.replace(request, resume=continuation(reference[:3], 1))
        return reference, await read(RequestProcessor(aengine, tiny_tokenizer, stream_interval=4), resumed)

    reference, rest = asyncio.run(with_async_engine(make_engine(paged_model), body))
    assert len(rest[0].token_ids) == 1
    assert per_choice(reference[:3] + rest, 1) == per_choice(reference, 1)


@pytest.mark.parametrize("resume, message", [
    (Continuation((ChoiceProgress((5,)), ChoiceProgress())), "2 choices given for a request of 1"),
    (Continuation((ChoiceProgress((5, 100_000)),)), "outside the vocabulary"),
])
def test_a_continuation_that_cannot_be_is_a_400(paged_model, tiny_tokenizer, resume, message):
    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        return await read(processor, dataclasses.replace(chat_request(9), resume=resume))

    [chunk] = asyncio.run(with_async_engine(make_engine(paged_model), body))
    assert (chunk.error.status, chunk.error.code, chunk.error.param) == (400, "invalid_continuation", "resume")
    assert message in chunk.error.message


def test_ids_past_a_stop_string_are_a_400(paged_model, tiny_tokenizer):
    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        free = await read(processor, chat_request(9, ignore_eos=True))
        text, ids = "".join(c.text for c in free), tuple(t for c in free for t in c.token_ids)
        stopped = chat_request(9, ignore_eos=True, stop=(text[:2],))  # it ends within the first tokens
        return await read(processor, dataclasses.replace(stopped, resume=Continuation((ChoiceProgress(ids),))))

    [chunk] = asyncio.run(with_async_engine(make_engine(paged_model), body))
    assert (chunk.error.status, chunk.error.code) == (400, "invalid_continuation")
    assert "after a stop string" in chunk.error.message


def test_beam_search_resumes_from_the_start_without_finished_beams(paged_model, tiny_tokenizer):
    request = chat_request(6, ignore_eos=True, use_beam_search=True, n=2)

    async def body(aengine):
        processor = RequestProcessor(aengine, tiny_tokenizer)
        reference = await read(processor, request)
        first = [c for c in reference if c.index == 0]
        resumed = dataclasses.replace(request, resume=continuation(first, 2))
        return reference, await read(processor, resumed)

    reference, rest = asyncio.run(with_async_engine(make_engine(paged_model), body))
    assert [c.index for c in rest] == [1]
    assert (rest[0].text, rest[0].token_ids) == (reference[1].text, reference[1].token_ids)
    assert rest[-1].completion_tokens == reference[-1].completion_tokens
