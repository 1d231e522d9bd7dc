"""Prefix-aware replica choice: send a request where the longest prefix of its prompt was
sent before (its KV blocks are likely cached there), or where its session belongs, unless
that replica is busier than the least loaded one by more than a margin. Replicas that hold
the same prefix (a system prompt every conversation shares) are told apart by load.

The decision is pure (replica ids and loads in, a replica id or None out) so it is tested
without Serve; serve_app/transport/router.py feeds it Serve's queue lengths and records
where each request went.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from serve_app.transport.prefix_index import (
    PrefixIndex,
    block_keys,
    prompt_text,
    rendezvous,
)
from workers.contract.requests import GenerateRequest


@dataclass(frozen=True)
class PrefixRoutingOptions:
    """The router's kwargs (workers/contract/model_config.py RoutingConfig, as a dict)."""

    prefix_aware: bool = True
    block_chars: int = 128
    load_margin: int = 8
    max_blocks: int = 100_000


class PrefixRouting:
    def __init__(self, options: PrefixRoutingOptions) -> None:
        self.options = options
        self._index = PrefixIndex(options.max_blocks)

    def keys(self, request: GenerateRequest) -> list[bytes]:
        return block_keys(prompt_text(request), self.options.block_chars)

    def preferred(self, request: GenerateRequest, keys: list[bytes], loads: Mapping[str, int]) -> str | None:
        """The replica this request should go to, or None for the load-only choice.
        `loads`: each candidate replica's ongoing requests."""
        if not loads:
            return None
        if request.session_key is not None:
            target = rendezvous(request.session_key, loads)
        else:
            target = self._deepest(keys, loads)
        if target is None or loads[target] - min(loads.values()) > self.options.load_margin:
            return None
        return target

    def _deepest(self, keys: list[bytes], loads: Mapping[str, int]) -> str | None:
        """The least loaded of the replicas holding the longest prefix; None when every
        replica holds as much as any other (then load alone decides)."""
        depths = self._index.depths(keys, loads.keys())
        deepest = max(depths.values(), default=0)
        if deepest == 0 or (len(depths) == len(loads) and min(depths.values()) == deepest):
            return None
        return min((r for r, d in depths.items() if d == deepest), key=lambda r: loads[r])

    def routed(self, keys: list[bytes], replica: str) -> None:
        """Where the request went (whichever way it was chosen): its prefix is cached there now."""
        self._index.record(keys, replica)
