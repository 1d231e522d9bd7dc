"""An ingress replica's channels to one worker deployment: one stream per worker replica,
opened as soon as the router sees the replica, carrying this ingress's chunks of every
step in one message; and each request's own call, which keeps Serve's per-request
behaviour (routing by load, `max_ongoing_requests`, 503s when queues are full,
autoscaling on ongoing requests, cancellation, the error of a dead replica).

A request names this ingress (`GenerateRequest.ingress_id`); the replica that runs it
puts its chunks on this ingress's channel when it has one open, else on the request's own
call. Chunks from either land in the request's mailbox (serve_app/transport/mailbox.py).

Resuming: when a request's stream breaks (its replica died, its channel broke), or its
replica leaves the router's set (scaled down, replaced by a redeploy: the hand-over is at
once, not after the grace period), the request is submitted again with a `Continuation`
(the token ids received per choice) under a new attempt id; Serve routes it to a live
replica, which goes on from there. Bounded by the model's `resume` config.

Prefill/decode disaggregation: the decode deployment's channels hold the prefill
deployment's (`prefill`). A request goes first to a prefill replica (`prefill_only`),
whose chunks land in the same mailbox; when that replica hands the request over (a chunk
with a `KVHandoff`, workers/contract/kv_handoff.py), it is submitted to the decode
deployment with a `Continuation` of what was received and the handoff, so the decode
replica takes the prompt's KV blocks instead of computing them. A prefill replica that
fails is a broken stream like any: the request resumes on a decode replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

from ray.serve.handle import DeploymentHandle

from serve_app.transport.mailbox import RequestMailbox
from serve_app.transport.replica_directory import (
    PIN_KEYWORD,
    ReplicaDirectory,
    deployment_key,
)
from workers.contract.kv_handoff import KVHandoff
from workers.contract.model_config import ResumeConfig
from workers.contract.requests import GenerateRequest
from workers.contract.transport import ChannelEndpoint, read_batch

logger = logging.getLogger("chatserve.ingress")

CONNECT_TIMEOUT_S = 5.0  # to a replica's channel socket; past it the Serve channel is used
REOPEN_DELAY_S = 1.0  # between tries to reopen a channel that ended while its replica is still listed
RETRY_DELAY_S = 0.5  # between tries to resume a request that no replica took yet


@dataclasses.dataclass
class _Losses:
    """A request's replica losses so far, and since when it has been waiting for a replica."""

    count: int = 0
    waiting_since: float | None = None


class WorkerChannels:
    def __init__(self, handle: DeploymentHandle, resume: ResumeConfig = ResumeConfig(),
                 prefill: "WorkerChannels | None" = None) -> None:
        """`handle`: the worker deployment's handle, options set (e.g. by value over gRPC);
        `prefill`: the channels of the model's prefill deployment, when disaggregated."""
        self.ingress_id = uuid.uuid4().hex
        self.resumes = 0  # requests resumed on another replica (a counter)
        self._prefill = prefill
        self._resume = resume
        self._losses: dict[str, _Losses] = {}
        self._handle = handle
        self._deployment = deployment_key(handle.app_name, handle.deployment_name)
        self._mailboxes: dict[str, RequestMailbox] = {}
        self._readers: dict[str, asyncio.Task] = {}  # worker replica -> the task reading its channel
        self._replicas: frozenset[str] = frozenset()  # the replicas the router names now
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def ready_replicas(self) -> int:
        """The worker replicas the router names now (running: Serve lists no other)."""
        return len(self._replicas)

    def start(self) -> None:
        """Follow the worker replicas (call on the ingress's event loop)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            ReplicaDirectory.subscribe(self._deployment, self._on_replicas)

    def stop(self) -> None:
        if self._prefill is not None:
            self._prefill.stop()
        ReplicaDirectory.unsubscribe(self._deployment, self._on_replicas)
        for reader in self._readers.values():
            reader.cancel()
        self._readers.clear()

    def call(self, gen_request: GenerateRequest) -> RequestMailbox:
        """Start the request; its chunks arrive in the returned mailbox."""
        self.start()
        request_id = gen_request.request_id
        mailbox = RequestMailbox(gen_request, lambda: self._forget(mailbox), self._on_broken, self._on_handoff)
        if self._prefill is not None and _prefills_apart(gen_request):
            prefill = dataclasses.replace(gen_request, request_id=f"{request_id}~prefill", prefill_only=True)
            self._prefill.carry(mailbox, prefill)
            return mailbox
        self._mailboxes[request_id] = mailbox
        mailbox.start(self._send(gen_request))
        return mailbox

    def carry(self, mailbox: RequestMailbox, request: GenerateRequest) -> None:
        """Run `request` (an attempt of `mailbox`'s request) on this deployment."""
        self.start()
        self._mailboxes[request.request_id] = mailbox
        mailbox.restart(self._send(request), request.request_id)

    def drop(self, mailbox: RequestMailbox) -> None:
        """Forget `mailbox`'s current attempt here (it ended, or goes on elsewhere)."""
        if self._mailboxes.get(mailbox.worker_request_id) is mailbox:
            del self._mailboxes[mailbox.worker_request_id]
            if mailbox.replica is not None:
                self._close_if_idle(mailbox.replica)

    def _holds(self, mailbox: RequestMailbox) -> bool:
        """`mailbox`'s current attempt runs here or on the prefill side."""
        sides = (self, self._prefill) if self._prefill is not None else (self,)
        return any(side._mailboxes.get(mailbox.worker_request_id) is mailbox for side in sides)

    def _on_handoff(self, mailbox: RequestMailbox, handoff: KVHandoff) -> None:
        """A prefill replica handed the request over: go on with it here."""
        if mailbox.complete or self._prefill is None or not self._holds(mailbox):
            return  # it ended, or its client left, meanwhile: nothing goes on
        self._prefill.drop(mailbox)
        attempt = f"{mailbox.request_id}~{uuid.uuid4().hex[:8]}"
        self._mailboxes[attempt] = mailbox
        request = dataclasses.replace(mailbox.request, request_id=attempt, resume=mailbox.continuation(),
                                      kv_handoff=handoff)
        mailbox.restart(self._send(request), attempt)

    def _send(self, request: GenerateRequest):
        handle = self._handle.options(stream=True)
        if request.lora is not None:  # Serve's model multiplexing: a replica that holds the adapter
            handle = handle.options(multiplexed_model_id=request.lora.key)
        return handle.generate.remote(dataclasses.replace(request, ingress_id=self.ingress_id))

    def _forget(self, mailbox: RequestMailbox) -> None:
        if self._prefill is not None:
            self._prefill.drop(mailbox)
        self._mailboxes.pop(mailbox.worker_request_id, None)
        self._losses.pop(mailbox.request_id, None)
        if mailbox.replica is not None:
            self._close_if_idle(mailbox.replica)

    def _on_broken(self, mailbox: RequestMailbox, reason: str, resumable: bool) -> bool:
        """Resume the request (True), or let it fail (False: resuming is off, spent, or late)."""
        if not (self._resume.enabled and resumable):
            return False
        losses = self._losses.setdefault(mailbox.request_id, _Losses())
        now = time.monotonic()
        retry = losses.waiting_since is not None and not mailbox.attempt_delivered  # still no replica took it
        if not retry:
            losses.count += 1
            losses.waiting_since = now
        if losses.count > self._resume.max_resumes or now - losses.waiting_since > self._resume.replica_wait_s:
            return False
        logger.info("resuming request %s on another replica (%s)", mailbox.request_id, reason)
        asyncio.get_running_loop().call_later(RETRY_DELAY_S if retry else 0.0, self._restart, mailbox, losses)
        return True

    def _restart(self, mailbox: RequestMailbox, losses: _Losses) -> None:
        if mailbox.complete or not self._holds(mailbox):
            return  # it ended (or was cancelled) meanwhile
        if self._prefill is not None:
            self._prefill.drop(mailbox)  # a prefill replica failed: the decode side runs it all
        self._mailboxes.pop(mailbox.worker_request_id, None)
        attempt = f"{mailbox.request_id}~{uuid.uuid4().hex[:8]}"
        self._mailboxes[attempt] = mailbox
        request = dataclasses.replace(mailbox.request, request_id=attempt, resume=mailbox.continuation())
        self.resumes += 1
        left = mailbox.replica
        mailbox.restart(self._send(request), attempt)
        if left is not None:
            self._close_if_idle(left)  # the last request of a replica that left: its channel goes

    def _hand_over(self, replica: str) -> None:
        """A replica left the router's set (stopping, or dead): move its requests now."""
        for mailbox in list(self._mailboxes.values()):
            if mailbox.replica == replica and not mailbox.complete:
                mailbox.broke(f"replica {replica} is leaving")

    def _on_replicas(self, replica_ids: frozenset[str]) -> None:
        # Called on the router's thread: the readers belong to the ingress's loop.
        try:
            self._loop.call_soon_threadsafe(self._follow, replica_ids)
        except RuntimeError:  # that loop is closed: this transport is gone
            ReplicaDirectory.unsubscribe(self._deployment, self._on_replicas)

    def _follow(self, replica_ids: frozenset[str]) -> None:
        self._replicas = replica_ids
        for replica in replica_ids - self._readers.keys():
            self._readers[replica] = asyncio.create_task(self._read(replica))
        for replica in self._readers.keys() - replica_ids:
            if replica_ids:  # another replica can take its requests: move them now
                self._hand_over(replica)
            self._close_if_idle(replica)

    def _close_if_idle(self, replica: str) -> None:
        """Close the channel of a replica that left the router's set, once no request uses
        it: a replica stopping with no other to hand over to finishes its requests first
        (within its graceful shutdown), and their chunks still come by this channel."""
        if replica in self._readers and replica not in self._replicas and \
                not any(m.replica == replica and not m.complete for m in self._mailboxes.values()):
            self._readers.pop(replica).cancel()

    async def _read(self, replica: str) -> None:
        """Keep this replica's channel open and deliver what it carries, until it is gone."""
        while True:
            self._channel_broke(replica, await self._read_channel(replica))
            await asyncio.sleep(REOPEN_DELAY_S)

    async def _read_channel(self, replica: str) -> str:
        """One channel's life: the replica's socket when it names one and it can be reached,
        else the messages of the Serve call itself. Returns why it ended."""
        pin = {PIN_KEYWORD: replica}
        call = self._handle.options(stream=True).channel.remote(self.ingress_id, socket=True, **pin)
        try:
            first = await anext(call)
            if isinstance(first, ChannelEndpoint):
                connection = await _connect(first, replica, self.ingress_id)
                if connection is not None:
                    return await self._read_socket(replica, call, *connection)
                call.cancel()
                call = self._handle.options(stream=True).channel.remote(self.ingress_id, **pin)
            else:  # a replica without a socket: its call carries the chunks
                self._deliver(first, replica)
            async for batch in call:
                self._deliver(batch, replica)
            return "its channel closed"
        except StopAsyncIteration:
            return "its channel closed"
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - the replica died or restarted; requests learn it
            logger.info("channel to worker replica %s ended: %s", replica, type(exc).__name__)
            return type(exc).__name__

    async def _read_socket(self, replica: str, call, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> str:
        """The socket's messages until it closes, or until the Serve call held open beside it
        ends (it holds the channel's place in the replica's `max_ongoing_requests`, and
        breaks when the replica dies even where no FIN reaches this end)."""

        async def frames() -> None:
            while (batch := await read_batch(reader)) is not None:
                self._deliver(batch, replica)

        reading, held = asyncio.ensure_future(frames()), asyncio.ensure_future(anext(call, None))
        try:
            done, _ = await asyncio.wait({reading, held}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a broken connection or call raises here
            return "its channel closed"
        finally:
            reading.cancel()
            held.cancel()
            call.cancel()
            writer.close()  # the replica closes this ingress's outbox

    def _deliver(self, batch, replica: str) -> None:
        mailboxes = self._mailboxes
        for request_id, chunk in batch:
            mailbox = mailboxes.get(request_id)
            if mailbox is not None:  # else: cancelled here meanwhile
                mailbox.put(chunk, from_channel=True, replica=replica)

    def _channel_broke(self, replica: str, reason: str) -> None:
        for mailbox in list(self._mailboxes.values()):
            if mailbox.replica == replica:
                mailbox.broke(f"its channel ended: {reason}")


async def _connect(endpoint: ChannelEndpoint, replica: str, ingress_id: str
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """A connection to the replica's channel socket that said whose it is (the replica's
    token, then this ingress's id), or None where it cannot be reached (then the Serve
    channel carries the chunks)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(endpoint.host, endpoint.port),
                                                CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        logger.warning("cannot reach the channel socket of worker replica %s at %s:%d (%s): using a Serve "
                       "streaming call", replica, endpoint.host, endpoint.port, exc)
        return None
    writer.write(f"{endpoint.token} {ingress_id}\n".encode())
    return reader, writer


def _prefills_apart(request: GenerateRequest) -> bool:
    """Whether a request goes to a prefill replica first: not one that resumes, nor beam
    search (its beams come out whole at the end, so there is no first token to hand
    over), nor one with images (the vision tower runs where the prompt is prefilled)."""
    return request.resume is None and not request.params.use_beam_search and not request.images
