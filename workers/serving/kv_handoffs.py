"""Both ends of a request's hand-over between replicas (prefill/decode disaggregation,
workers/contract/kv_handoff.py): a prefill replica's store of prompt KV blocks waiting to
be taken, and a decode replica's taking of them into its own cache.

The store keeps each payload until a decode replica takes it, or for `ttl_s` (the
request was cancelled, or its decode replica went away and the resume computes the
prompt again). Taking goes by `fetch`, a call pinned to the prefill replica that the
worker deployment supplies, for the blocks after those the decode replica caches already
(an earlier turn of the conversation); any failure there only costs the decode replica
the prefill.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from workers.contract.kv_handoff import KVHandoff
from workers.engine.kv_transfer import KVBlocks
from workers.serving.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 60.0

Fetch = Callable[[KVHandoff, int], Awaitable[KVBlocks | None]]  # (hand-over, blocks held already)


@dataclass
class TransferStats:
    """Counters of one replica's hand-overs."""

    sent: int = 0  # requests handed over (prefill side)
    received: int = 0  # hand-overs whose blocks were taken and written here (decode side)
    missed: int = 0  # hand-overs whose blocks could not be had: the prompt computed again
    tokens: int = 0  # prompt tokens whose K/V were taken
    held_tokens: int = 0  # prompt tokens of hand-overs this replica held already (not taken)
    bytes: int = 0  # K/V bytes taken
    ms: float = 0.0  # time taking and writing them


class KVHandoffs:
    def __init__(self, engine: AsyncEngine, replica: str = "", fetch: Fetch | None = None,
                 ttl_s: float = DEFAULT_TTL_S) -> None:
        """`replica`: this replica's id (named in its hand-overs); `fetch`: takes a hand-over's
        blocks from its prefill replica (decode side)."""
        self.engine = engine
        self.replica = replica
        self.stats = TransferStats()
        self._fetch = fetch
        self._ttl_s = ttl_s
        self._waiting: dict[str, tuple[KVBlocks, float]] = {}

    async def hand_off(self, prompt_ids: list[int], lora: str | None, cached_tokens: int | None) -> KVHandoff:
        """Keep the prompt's cached blocks for a decode replica; the hand-over naming them
        (0 tokens when none is cached: the decode replica computes the prompt).
        `cached_tokens`: the request's own prefix-cache hits, for its usage."""
        self._expire()
        payload = await self.engine.call(lambda engine: engine.export_prefix(prompt_ids, lora))
        self.stats.sent += 1
        if payload is None:
            return KVHandoff(self.replica, "", 0, 0, cached_tokens)
        key = uuid.uuid4().hex
        self._waiting[key] = (payload, time.monotonic())
        return KVHandoff(self.replica, key, len(payload.token_ids), payload.nbytes, cached_tokens)

    def take(self, key: str, held_blocks: int = 0) -> KVBlocks | None:
        """The payload of a hand-over, once, less the first `held_blocks` blocks the receiver
        has (None: expired, or taken already)."""
        entry = self._waiting.pop(key, None)
        return entry[0].after(held_blocks) if entry is not None else None

    async def receive(self, handoff: KVHandoff, prompt_ids: list[int], lora: str | None) -> int:
        """Take a hand-over's blocks into this replica's cache before its request is queued;
        returns the blocks written (0 when they could not be had or do not fit the prompt)."""
        if not handoff.tokens or self._fetch is None:
            return 0
        start = time.perf_counter()
        held = await self.engine.call(lambda engine: engine.held_prefix_blocks(prompt_ids, lora))
        try:
            payload = await self._fetch(handoff, held)
        except Exception as exc:  # noqa: BLE001 - the prefill replica went away: compute the prompt here
            logger.warning("taking KV blocks from prefill replica %s failed (%s): computing the prompt",
                           handoff.replica, type(exc).__name__)
            payload = None
        if payload is None or payload.token_ids != prompt_ids[:len(payload.token_ids)]:
            self.stats.missed += 1
            return 0
        written = await self.engine.call(lambda engine: engine.import_prefix(payload, lora))
        self.stats.received += 1
        block_size = payload.block_size
        self.stats.held_tokens += payload.first_block * block_size
        self.stats.tokens += len(payload.token_ids) - payload.first_block * block_size
        self.stats.bytes += payload.nbytes
        self.stats.ms += (time.perf_counter() - start) * 1000
        return written

    def _expire(self) -> None:
        oldest = time.monotonic() - self._ttl_s
        for key in [k for k, (_, made) in self._waiting.items() if made < oldest]:
            del self._waiting[key]
