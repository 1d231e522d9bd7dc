"""Prefill/decode disaggregation on the worker (workers/serving/kv_handoffs.py): a prefill
replica's request ends once each choice has its first token, with a hand-over chunk; the
ingress's continuation of what arrived, given to a decode replica with the hand-over,
gives the client exactly the colocated stream (text, ids, finish, usage), the decode
replica taking the prompt's KV blocks instead of computing them. On the tiny model, for
greedy, seeded n = 2, stop-string and JSON-schema requests; a hand-over whose blocks
cannot be had still gives the same stream (the prompt computed again)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from tests.support.engines import make_engine, with_async_engine
from tests.unit.serving.test_resume_stream import (
    SCHEMA,
    chat_request,
    continuation,
    per_choice,
    read,
)
from workers.contract.kv_handoff import KVHandoff
from workers.contract.sampling_params import GuidedDecoding
from workers.serving.async_engine import AsyncEngine
from workers.serving.kv_handoffs import KVHandoffs
from workers.serving.request_processor import RequestProcessor

REQUESTS = {
    "greedy": chat_request(24, ignore_eos=True),
    "seeded-n2": chat_request(16, ignore_eos=True, temperature=0.9, seed=77, n=2),
    "stop-string": chat_request(30, ignore_eos=True, stop=("e", "never appears")),
    "json-schema": chat_request(64, temperature=1.0, seed=9,
                                guided=GuidedDecoding(kind="json_schema", spec=json.dumps(SCHEMA))),
}


def disaggregated(model, tokenizer, request, lose_blocks: bool = False, warm_decode: bool = False):
    """(colocated chunks, prefill chunks, decode chunks, decode side's transfer stats, blocks the
    decode engine found cached). `warm_decode`: the decode side ran the request before (it
    caches the prompt's blocks)."""
    eos = frozenset({tokenizer.eos_token_id})
    colocated_engine = make_engine(model, eos=eos, tokenizer=tokenizer)
    prefill_engine, decode_engine = (make_engine(model, eos=eos, tokenizer=tokenizer) for _ in range(2))

    async def body(colocated: AsyncEngine):
        loop = asyncio.get_running_loop()
        prefill, decode = AsyncEngine(prefill_engine), AsyncEngine(decode_engine)
        prefill.start(loop)
        decode.start(loop)
        try:
            sent = KVHandoffs(prefill, replica="p")

            async def fetch(handoff: KVHandoff, held_blocks: int):
                assert handoff.replica == "p" and (held_blocks > 0) == warm_decode
                return None if lose_blocks else sent.take(handoff.key, held_blocks)

            received = KVHandoffs(decode, replica="d", fetch=fetch)
            reference = await read(RequestProcessor(colocated, tokenizer), request)
            if warm_decode:
                await read(RequestProcessor(decode, tokenizer), request)
                hits_before = decode_engine.blocks.hit_tokens
            first = await read(RequestProcessor(prefill, tokenizer, handoffs=sent),
                               dataclasses.replace(request, prefill_only=True))
            *out, last = first
            assert last.handoff is not None and not last.token_ids and not last.text
            assert all(c.finish_reason is None for c in out)  # the cut is not the client's end
            onward = dataclasses.replace(request, resume=continuation(out, request.params.n), kv_handoff=last.handoff)
            rest = await read(RequestProcessor(decode, tokenizer, handoffs=received), onward)
            if warm_decode:
                decode_engine.blocks.hit_tokens -= hits_before
            return reference, out, rest, received.stats
        finally:
            prefill.stop()
            decode.stop()

    reference, out, rest, stats = asyncio.run(with_async_engine(colocated_engine, body))
    return reference, out, rest, stats, decode_engine.blocks.hit_tokens


@pytest.mark.parametrize("name", list(REQUESTS))
def test_the_disaggregated_stream_is_the_colocated_one(paged_model, tiny_tokenizer, name):
    request = REQUESTS[name]
    reference, out, rest, stats, hits = disaggregated(paged_model, tiny_tokenizer, request)
    n = request.params.n
    stream = out + rest
    assert all(c.error is None for c in stream)
    assert per_choice(stream, n) == per_choice(reference, n)
    assert stream[-1].completion_tokens == reference[-1].completion_tokens
    assert stream[-1].cached_tokens == reference[-1].cached_tokens == 0  # the import's hits are not the client's
    assert {c.index for c in out if c.token_ids} == set(range(n))  # each choice's first token came from P
    assert stats.received == 1 and stats.bytes > 0 and stats.missed == 0
    assert hits >= n * 4  # the decode engine found the prompt's blocks (block size 4) cached


def test_blocks_that_cannot_be_had_cost_only_the_prefill(paged_model, tiny_tokenizer):
    request = REQUESTS["greedy"]
    reference, out, rest, stats, hits = disaggregated(paged_model, tiny_tokenizer, request, lose_blocks=True)
    assert per_choice(out + rest, 1) == per_choice(reference, 1)
    assert stats.missed == 1 and stats.received == 0 and hits == 0


def test_a_request_that_ends_at_its_first_token_is_not_handed_over(paged_model, tiny_tokenizer):
    request = dataclasses.replace(chat_request(1, ignore_eos=True), prefill_only=True)

    async def body(engine: AsyncEngine):
        handoffs = KVHandoffs(engine, replica="p")
        return await read(RequestProcessor(engine, tiny_tokenizer, handoffs=handoffs), request), handoffs.stats

    chunks, stats = asyncio.run(with_async_engine(make_engine(paged_model), body))
    assert [c.finish_reason for c in chunks] == ["length"] and all(c.handoff is None for c in chunks)
    assert stats.sent == 0


def test_a_decode_replica_that_holds_the_prompt_takes_no_blocks(paged_model, tiny_tokenizer):
    request = REQUESTS["greedy"]
    reference, out, rest, stats, hits = disaggregated(paged_model, tiny_tokenizer, request, warm_decode=True)
    assert per_choice(out + rest, 1) == per_choice(reference, 1)
    assert stats.received == 1 and stats.tokens == 0 and stats.held_tokens >= 4 and stats.bytes == 0
    assert hits >= 4
