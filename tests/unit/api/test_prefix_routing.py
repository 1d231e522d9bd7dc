"""Prefix-aware routing without Serve: prompt blocks and their chained keys, the index of
where prefixes went, and the replica choice with its load margin and session keys."""

from __future__ import annotations

import dataclasses

from serve_app.transport.prefix_index import (
    PrefixIndex,
    block_keys,
    prompt_text,
    rendezvous,
)
from serve_app.transport.prefix_routing import PrefixRouting, PrefixRoutingOptions
from workers.contract.requests import GenerateRequest, ImageData, LoraRequest
from workers.contract.sampling_params import SamplingParams

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 20}


def chat(*messages: dict, **fields) -> GenerateRequest:
    return GenerateRequest(request_id="r", params=SamplingParams(), messages=list(messages), **fields)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_shared_text_prefix_gives_shared_keys_up_to_the_block_that_differs():
    a = block_keys("x" * 100 + "A" * 60, 32)
    b = block_keys("x" * 100 + "B" * 60, 32)
    assert len(a) == len(b) == 5  # 160 characters: 5 whole blocks of 32
    assert a[:3] == b[:3]  # characters 0-95 shared
    assert a[3] != b[3] and a[4] != b[4]  # block 3 holds the first difference; later keys are chained


def test_a_partial_last_block_has_no_key():
    assert block_keys("y" * 31, 32) == []
    assert len(block_keys("y" * 64, 32)) == 2


def test_prompt_text_depends_on_what_the_prompt_depends_on():
    base = chat(SYSTEM, user("hi"))
    assert prompt_text(base) == prompt_text(chat(SYSTEM, user("hi")))
    assert prompt_text(base) != prompt_text(chat(SYSTEM, user("hj")))
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert prompt_text(base) != prompt_text(chat(SYSTEM, user("hi"), tools=[tool]))
    assert prompt_text(base) != prompt_text(chat(SYSTEM, user("hi"), lora=LoraRequest(name="a", key="a1", path="/a")))
    with_image = [{"type": "text", "text": "see"}, {"type": "image", "image_index": 0}]
    one = chat(SYSTEM, {"role": "user", "content": with_image}, images=(ImageData(b"png-1", "p"),))
    two = chat(SYSTEM, {"role": "user", "content": with_image}, images=(ImageData(b"png-2", "p"),))
    assert prompt_text(one) != prompt_text(two)
    completion = GenerateRequest(request_id="r", params=SamplingParams(), prompt="Once upon")
    assert prompt_text(completion).endswith("Once upon")


def test_index_gives_each_replica_the_prefix_it_holds():
    keys = block_keys("z" * 320, 32)  # 10 blocks
    index = PrefixIndex(max_blocks=100)
    index.record(keys[:3], "a")
    index.record(keys[:7], "b")  # b was sent a longer prompt with the same start
    assert index.depths(keys, {"a", "b"}) == {"a": 3, "b": 7}
    assert index.depths(keys, {"a"}) == {"a": 3}  # b gone: its entries are skipped
    assert index.depths(block_keys("q" * 64, 32), {"a", "b"}) == {}


def test_index_forgets_least_recently_used_blocks_beyond_its_bound():
    index = PrefixIndex(max_blocks=4)
    old, new = block_keys("o" * 64, 32), block_keys("n" * 128, 32)
    index.record(old, "a")
    index.record(new, "b")
    assert len(index) == 4
    assert index.depths(old, {"a", "b"}) == {}
    assert index.depths(new, {"a", "b"}) == {"b": 4}


def test_next_turn_of_a_conversation_goes_where_the_last_turn_went():
    routing = PrefixRouting(PrefixRoutingOptions(block_chars=64))
    turn1 = chat(SYSTEM, user("What is the capital of France? " * 3))
    routing.routed(routing.keys(turn1), "a")
    other = chat(SYSTEM, user("Something else entirely, and long enough to fill blocks. " * 3))
    routing.routed(routing.keys(other), "b")  # b holds the shared system prompt too
    turn2 = chat(*turn1.messages, {"role": "assistant", "content": "Paris."}, user("And of Spain?"))
    assert routing.preferred(turn2, routing.keys(turn2), {"a": 3, "b": 3}) == "a"


def test_replicas_holding_the_same_prefix_are_told_apart_by_load():
    routing = PrefixRouting(PrefixRoutingOptions(block_chars=64))
    for replica, text in (("a", "first question " * 8), ("b", "second question " * 8)):
        routing.routed(routing.keys(chat(SYSTEM, user(text))), replica)
    new = chat(SYSTEM, user("a new conversation " * 8))  # both hold its system prompt, no more
    assert routing.preferred(new, routing.keys(new), {"a": 3, "b": 3}) is None  # load decides
    assert routing.preferred(new, routing.keys(new), {"a": 3, "b": 3, "c": 0}) in ("a", "b")  # c holds nothing
    only_a = chat(user("seen by a only " * 10))
    routing.routed(routing.keys(only_a), "a")
    assert routing.preferred(only_a, routing.keys(only_a), {"a": 5, "b": 1}) == "a"


def test_a_preferred_replica_busier_than_the_margin_is_skipped():
    routing = PrefixRouting(PrefixRoutingOptions(block_chars=64, load_margin=4))  # 8 by default
    turn1 = chat(SYSTEM, user("hello " * 30))
    keys = routing.keys(turn1)
    routing.routed(keys, "a")
    assert routing.preferred(turn1, keys, {"a": 6, "b": 2}) == "a"  # 4 above: within the margin
    assert routing.preferred(turn1, keys, {"a": 7, "b": 2}) is None  # 5 above: load decides
    fresh = chat(user("nothing shared with anything routed so far " * 5))
    assert routing.preferred(fresh, routing.keys(fresh), {"a": 0, "b": 0}) is None
    assert routing.preferred(turn1, keys, {}) is None


def test_a_session_stays_on_one_replica_in_every_router():
    first, second = (PrefixRouting(PrefixRoutingOptions()) for _ in range(2))  # two ingress replicas
    loads = {"a": 1, "b": 1, "c": 1}
    for n in range(20):
        request = chat(user(f"turn of session {n}"), session_key=f"s{n}")
        chosen = first.preferred(request, first.keys(request), loads)
        assert chosen == second.preferred(request, second.keys(request), loads) == rendezvous(f"s{n}", loads)
    request = chat(user("x"), session_key="s1")
    overloaded = {**loads, rendezvous("s1", loads): 50}
    assert first.preferred(request, [], overloaded) is None


def test_losing_a_replica_moves_only_the_sessions_it_held():
    replicas = ["a", "b", "c", "d"]
    before = {n: rendezvous(f"s{n}", replicas) for n in range(200)}
    after = {n: rendezvous(f"s{n}", ["a", "b", "c"]) for n in range(200)}
    moved = {n for n in before if before[n] != after[n]}
    assert moved == {n for n in before if before[n] == "d"}
    assert 20 < len(moved) < 80  # about a quarter of them


def test_options_are_the_config_fields():
    from workers.contract.model_config import RoutingConfig

    assert {f.name for f in dataclasses.fields(PrefixRoutingOptions)} == set(RoutingConfig.model_fields)
    assert PrefixRoutingOptions(**RoutingConfig().model_dump()) == PrefixRoutingOptions()


def test_a_token_id_prompt_keys_by_its_ids():
    def ids(*token_ids):
        return GenerateRequest(request_id="r", params=SamplingParams(), prompt_token_ids=token_ids)

    assert prompt_text(ids(1, 2, 3)) == prompt_text(ids(1, 2, 3))
    assert prompt_text(ids(1, 2, 3)).startswith(prompt_text(ids(1, 2)))  # a shared prefix stays a prefix
    assert prompt_text(ids(12, 3)) != prompt_text(ids(1, 23))
    assert prompt_text(ids(1, 2)) != prompt_text(GenerateRequest(request_id="r", params=SamplingParams(), prompt="1 2"))
