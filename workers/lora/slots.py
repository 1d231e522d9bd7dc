"""Which adapter each device slot holds, how many running sequences use it, and which
idle one is evicted first.

A replica has `max_loras` slots (the stacked weights in every LoRA layer are that many
adapters wide, so their shapes never change and CUDA graphs can read them). A sequence
takes its adapter's slot when it is admitted and gives it back when it finishes or is
preempted. An adapter nobody runs stays in its slot (a later request finds it there) until
a slot is needed for another: then the least recently used idle adapter is evicted. When
every slot is held by running sequences, a new adapter's request waits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotGrant:
    slot: int
    needs_load: bool  # the slot held another adapter (or none): write this one's weights first


class LoraSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be positive, not {num_slots}")
        self.num_slots = num_slots
        self._holder: list[str | None] = [None] * num_slots
        self._slot_of: dict[str, int] = {}
        self._users: dict[str, int] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()  # resident and unused, least recently used first

    def slot_of(self, key: str) -> int | None:
        return self._slot_of.get(key)

    def users(self, key: str) -> int:
        return self._users.get(key, 0)

    @property
    def resident(self) -> list[str]:
        return list(self._slot_of)

    def acquire(self, key: str) -> SlotGrant | None:
        """A slot holding `key` for one more user; None when every slot is in use."""
        slot = self._slot_of.get(key)
        needs_load = slot is None
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._holder[slot] = key
            self._slot_of[key] = slot
        self._idle.pop(key, None)
        self._users[key] = self._users.get(key, 0) + 1
        return SlotGrant(slot, needs_load)

    def release(self, key: str) -> None:
        """One user of `key` is done; with none left it becomes the most recently used idle adapter."""
        left = self._users[key] - 1
        if left:
            self._users[key] = left
            return
        del self._users[key]
        self._idle[key] = None

    def _free_slot(self) -> int | None:
        if None in self._holder:
            return self._holder.index(None)
        if not self._idle:
            return None
        evicted, _ = self._idle.popitem(last=False)
        return self._slot_of.pop(evicted)
