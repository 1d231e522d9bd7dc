"""A prefill replica's hand-over of a request to a decode replica (prefill/decode
disaggregation, `disaggregation` in the model config).

The prefill replica runs the request until each choice has its first token, then keeps
the prompt's KV blocks in a store of its own and ends its stream with a chunk carrying a
`KVHandoff`. The ingress resumes the request on a decode replica (a `Continuation` of the
tokens sent so far, workers/contract/continuation.py) with the handoff attached; the
decode replica takes the blocks from the prefill replica by a call pinned to it, writes
them into its own prefix cache and goes on, computing only the prompt's last partial
block and the first token again.

Plain frozen dataclasses: cheap to pickle across Ray, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVHandoff:
    """Where a request's prompt KV blocks wait: `key` in the store of the prefill replica
    `replica` (Serve's unique replica id); `tokens` prompt tokens (whole blocks), `nbytes`
    their K and V. `cached_tokens`: the prompt tokens the prefill replica found in its
    prefix cache, what the request's usage reports (the decode replica's hits on the
    handed-over blocks are not the client's)."""

    replica: str
    key: str
    tokens: int
    nbytes: int
    cached_tokens: int | None = None
