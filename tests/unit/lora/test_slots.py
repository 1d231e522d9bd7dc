"""Adapter slots: a slot per resident adapter, reuse without reloading, least-recently-used
eviction of idle adapters only, and waiting when every slot is in use."""

from __future__ import annotations

import pytest

from workers.lora.slots import LoraSlots, SlotGrant


def test_acquire_loads_once_and_shares_the_slot():
    slots = LoraSlots(2)
    assert slots.acquire("a") == SlotGrant(0, needs_load=True)
    assert slots.acquire("a") == SlotGrant(0, needs_load=False)
    assert slots.users("a") == 2
    assert slots.acquire("b") == SlotGrant(1, needs_load=True)


def test_every_slot_in_use_means_wait():
    slots = LoraSlots(2)
    slots.acquire("a")
    slots.acquire("b")
    assert slots.acquire("c") is None
    slots.release("b")  # idle now: evictable
    assert slots.acquire("c") == SlotGrant(1, needs_load=True)
    assert slots.slot_of("b") is None and slots.resident == ["a", "c"]


def test_least_recently_used_idle_adapter_is_evicted_first():
    slots = LoraSlots(3)
    for key in "abc":
        slots.acquire(key)
    for key in "bac":  # idle in this order: b least recently used
        slots.release(key)
    assert slots.acquire("d").slot == 1  # b's slot
    slots.acquire("a")  # a used again: c is now the least recently used idle one
    slots.release("a")
    assert slots.acquire("e").slot == 2  # c's slot
    assert sorted(slots.resident) == ["a", "d", "e"]


def test_an_idle_adapter_is_found_again_without_reloading():
    slots = LoraSlots(1)
    slots.acquire("a")
    slots.release("a")
    assert slots.acquire("a") == SlotGrant(0, needs_load=False)


def test_release_without_acquire_is_a_bug():
    with pytest.raises(KeyError):
        LoraSlots(1).release("a")
    with pytest.raises(ValueError):
        LoraSlots(0)
