"""Chunks waiting for a slow consumer, merged per request and choice: a backlog is one chunk.

Both ends of the worker -> ingress transport queue chunks here: the worker while a step's
message is being sent, the ingress while a client's connection is being written. Nothing
waits on a timer: a consumer that keeps up takes every chunk as it comes, and one that
falls behind takes, per choice, everything since its last take as one chunk (one message,
one SSE event). Torch-free, so both sides import it.
"""

from __future__ import annotations

from workers.contract.chunks import GenerationChunk

# (request id, choice index, generation): a new generation starts where chunks cannot merge.
_Key = tuple[str, int, int]


def merge_chunk(pending: GenerationChunk, newer: GenerationChunk) -> bool:
    """Fold `newer` into `pending`, the chunk of the same choice that came before it and was
    not taken yet; False (nothing changed) when they must stay apart: an error, a hand-over,
    or a choice that already finished."""
    if pending.error is not None or newer.error is not None or pending.finish_reason is not None:
        return False
    if pending.handoff is not None or newer.handoff is not None:
        return False  # a hand-over stays a chunk of its own, after the tokens before it
    if newer.prompt_logprobs is not None and pending.prompt_logprobs is not None:
        return False
    pending.text += newer.text
    pending.token_ids.extend(newer.token_ids)
    pending.decode_times_ms.extend(newer.decode_times_ms)
    if newer.logprobs is not None:
        pending.logprobs = (pending.logprobs or []) + newer.logprobs
    pending.prompt_logprobs = pending.prompt_logprobs or newer.prompt_logprobs
    pending.finish_reason, pending.stop_reason = newer.finish_reason, newer.stop_reason
    pending.completion_tokens = newer.completion_tokens
    if newer.cached_tokens is not None:
        pending.cached_tokens = newer.cached_tokens
    if pending.prefill_time_ms is None:
        pending.prefill_time_ms = newer.prefill_time_ms
    if pending.queue_time_ms is None:
        pending.queue_time_ms = newer.queue_time_ms
    return True


class CoalescingQueue:
    """Chunks of many requests in arrival order, each choice's backlog merged into one."""

    def __init__(self) -> None:
        self._pending: dict[_Key, GenerationChunk] = {}
        self._latest: dict[tuple[str, int], _Key] = {}  # the newest key of each (request, choice)

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, request_id: str, chunk: GenerationChunk) -> None:
        latest = self._latest.get((request_id, chunk.index))
        if latest is not None and latest in self._pending and merge_chunk(self._pending[latest], chunk):
            return
        key = (request_id, chunk.index, latest[2] + 1 if latest is not None else 0)
        self._pending[key] = chunk
        self._latest[(request_id, chunk.index)] = key

    def holds(self, request_id: str) -> bool:
        """Whether a chunk of this request is pending (a scan: pending chunks are few)."""
        return any(key[0] == request_id for key in self._pending)

    def take_all(self) -> list[tuple[str, GenerationChunk]]:
        """Everything pending, oldest first; the queue is empty afterwards."""
        taken = [(key[0], chunk) for key, chunk in self._pending.items()]
        self._pending.clear()
        return taken

    def drop(self, request_id: str) -> None:
        """Forget a request's pending chunks and its choices (it was cancelled)."""
        for key in [k for k in self._pending if k[0] == request_id]:
            del self._pending[key]
        for key in [k for k in self._latest if k[0] == request_id]:
            del self._latest[key]

    def forget(self, request_id: str, num_choices: int) -> None:
        """A finished request's bookkeeping, once its last chunk was put (cheap: no scan)."""
        for index in range(num_choices):
            self._latest.pop((request_id, index), None)
