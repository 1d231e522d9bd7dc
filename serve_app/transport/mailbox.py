"""One request's chunks at the ingress, from wherever they come: its own worker call, or
the channel of the worker replica that runs it; read as a stream of chunks.

Chunks that arrive while the reader is busy (writing to the client) merge per choice
(workers/contract/coalescing.py), so a slow client costs one event per write, not one
per token. The request is complete when every choice has finished or an error came.
A stream that breaks first (the replica died, its channel broke, or it ended early) is
handed to `on_broken`, which may resume the request elsewhere from the token ids this
mailbox received (serve_app/transport/channels.py); otherwise the request ends with a
503 `worker_failed` chunk. A prefill replica's hand-over chunk (prefill/decode
disaggregation) never reaches the reader: it goes to `on_handoff`, which goes on with the
request on a decode replica the same way.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError

from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.coalescing import CoalescingQueue
from workers.contract.continuation import ChoiceProgress, Continuation
from workers.contract.kv_handoff import KVHandoff
from workers.contract.requests import GenerateRequest
from workers.contract.transport import ChannelReceipt

logger = logging.getLogger("chatserve.ingress")


def worker_failed(reason: str) -> GenerationChunk:
    return GenerationChunk(error=ErrorInfo(503, f"the model worker failed ({reason}); retry the request",
                                           type="server_error", code="worker_failed"))


class RequestMailbox:
    def __init__(self, request: GenerateRequest, release: Callable[[], None] = lambda: None,
                 on_broken: Callable[[RequestMailbox, str, bool], bool] = lambda mailbox, reason, resumable: False,
                 on_handoff: Callable[[RequestMailbox, KVHandoff], None] | None = None) -> None:
        """`release` runs once when the request is done with (read to the end, or cancelled).
        `on_broken(mailbox, reason, resumable)` is told of a broken stream; True: it resumes
        the request (`restart` follows), False: the request ends with a 503.
        `on_handoff(mailbox, handoff)`: a prefill replica handed the request over; it
        restarts the request on a decode replica (None: treated as a broken stream)."""
        self.request = request
        self.request_id = request.request_id
        self.worker_request_id = request.request_id  # the current attempt's id on the worker
        self.replica: str | None = None  # the worker replica whose channel delivered to it, once known
        self.attempt_delivered = False  # the current attempt has delivered a chunk
        self._broken_attempt: str | None = None  # the attempt whose break was handled
        self._queue = CoalescingQueue()
        self._ready = asyncio.Event()
        self._taken: collections.deque[GenerationChunk] = collections.deque()
        n = request.params.n
        self._received: list[list[int]] = [[] for _ in range(n)]  # token ids per choice, for a resume
        self._unfinished = set(range(n))
        self._failed = False  # an error chunk arrived: nothing follows it
        self._overloaded: BackPressureError | None = None
        self._control: asyncio.Task | None = None
        self._call = None
        self._control_done = False
        self._expected: int | None = None  # channel entries the worker says it sent
        self._channel_entries = 0  # channel entries that arrived
        self._arrived = False  # any chunk, by either way, any attempt
        self._release = release
        self._on_broken = on_broken
        self._on_handoff = on_handoff

    def start(self, call) -> None:
        """Read the worker call (its own chunks, or the receipt of what its replica's channel sent)."""
        self._call = call
        self._control = asyncio.create_task(self._read_control(call))

    def restart(self, call, worker_request_id: str) -> None:
        """Go on with a new attempt (a continuation on another replica); the old call is dropped."""
        self._stop_call()
        self.worker_request_id = worker_request_id
        self.replica = None
        self.attempt_delivered = False
        self._control_done = False
        self._expected = None
        self._channel_entries = 0
        self.start(call)

    def continuation(self) -> Continuation:
        """What the client has of each choice (the ids of the chunks received)."""
        return Continuation(tuple(ChoiceProgress(tuple(ids), i not in self._unfinished)
                                  for i, ids in enumerate(self._received)))

    def put(self, chunk: GenerationChunk, from_channel: bool = False, replica: str | None = None) -> None:
        if from_channel:
            self._channel_entries += 1
            self.replica = self.replica or replica
        self._arrived = self.attempt_delivered = True
        if chunk.handoff is not None:
            self._hand_over(chunk.handoff)
            return
        if chunk.error is not None:
            self._failed = True
        else:
            self._received[chunk.index].extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                self._unfinished.discard(chunk.index)
        self._queue.put(self.request_id, chunk)
        self._ready.set()
        if self.complete:
            self._release_once()  # nothing more can come for it

    def _hand_over(self, handoff: KVHandoff) -> None:
        if self.complete or self._broken_attempt == self.worker_request_id:
            return
        if self._on_handoff is None:
            self.broke("a hand-over with no decode side to take it")
            return
        self._broken_attempt = self.worker_request_id  # this attempt is over: its stream's end is no break
        self._on_handoff(self, handoff)

    def broke(self, reason: str, resumable: bool = True) -> None:
        """The stream of the current attempt broke: resume the request, or end it with a 503.
        Handled once per attempt: its call and its channel often break together."""
        if self.complete or self._broken_attempt == self.worker_request_id:
            return
        self._broken_attempt = self.worker_request_id
        if not self._on_broken(self, reason, resumable):
            self.put(worker_failed(reason))

    @property
    def complete(self) -> bool:
        return self._failed or not self._unfinished

    def __aiter__(self) -> RequestMailbox:
        return self

    async def __anext__(self) -> GenerationChunk:
        while not self._taken:
            self._taken.extend(chunk for _, chunk in self._queue.take_all())
            if self._taken:
                break
            if self._overloaded is not None:
                raise self._overloaded
            if self.complete:
                raise StopAsyncIteration
            if self._control_done and self._channel_entries >= (self._expected or 0):
                if not self._arrived:
                    raise StopAsyncIteration  # nothing at all: the caller says so (an empty call is a bug)
                self._control_done = False  # handled once
                self.broke("its stream ended before the request did")
                continue
            self._ready.clear()
            await self._ready.wait()
        return self._taken.popleft()

    def cancel(self) -> None:
        """Stop the request (the client left, or the reader stopped early); frees the worker's sequence."""
        self._stop_call()
        self._release_once()

    def _stop_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._control is not None:
            self._control.cancel()

    async def _read_control(self, call) -> None:
        try:
            async for message in call:
                if call is not self._call:
                    return  # replaced by a new attempt: its chunks would not match the continuation
                if isinstance(message, ChannelReceipt):
                    self._expected = message.entries
                else:
                    for chunk in message:
                        self.put(chunk)
        except BackPressureError as exc:
            if call is not self._call:
                return  # an attempt already replaced: what became of it no longer matters
            if self._arrived:  # a resumed request: its client is waiting; try again
                self.broke("every replica is busy")
            else:
                self._overloaded = exc
                self._release_once()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any worker-side failure ends this request only
            # A replaced attempt's call ends with RequestCancelledError (restart cancelled it),
            # sometimes before this task's own cancellation lands: it must not break the new one.
            if call is not self._call:
                return
            logger.warning("model worker call failed: %s", type(exc).__name__)
            # The worker's own code raising is a bug a retry repeats; a dead replica is not.
            self.broke(type(exc).__name__, resumable=not isinstance(exc, RayTaskError))
            return
        if call is not self._call:
            return
        self._control_done = True
        self._ready.set()

    def _release_once(self) -> None:
        release, self._release = self._release, lambda: None
        release()
