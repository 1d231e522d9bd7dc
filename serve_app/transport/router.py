"""The request router of every model-worker deployment (Ray Serve's request-router API).

A generation request goes where its prompt's longest prefix went before, or where its
session belongs (serve_app/transport/prefix_routing.py), unless that replica is busier
than the least loaded one by the model's `routing.load_margin`; otherwise, and for every
other call, as Serve's default router routes (power of two choices among replicas with
room). A call that names a replica (`replica=` keyword: the ingress's channel opens, a
benchmark reads one replica's stats) goes to that replica and no other. The router runs inside
each caller's process; it publishes the replica set it sees to that process's
`ReplicaDirectory` (serve_app/transport/replica_directory.py), so the ingress's channels
follow replicas as they come and go.

Serve ships this module to the callers pickled by value: state shared with the ingress
must live in another module (the directory does), or each side would hold its own copy.
"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import (
    PowerOfTwoChoicesRequestRouter,
)
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RunningReplica,
)

from serve_app.transport.prefix_routing import PrefixRouting, PrefixRoutingOptions
from serve_app.transport.replica_directory import (
    PIN_KEYWORD,
    ReplicaDirectory,
    deployment_key,
)
from workers.contract.requests import GenerateRequest

ROUTER_CLASS = "serve_app.transport.router:WorkerRouter"


def replica_key(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


def generate_request(pending_request: PendingRequest | None) -> GenerateRequest | None:
    """The GenerateRequest of a `generate` call (None for channels, stats, ...)."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, GenerateRequest) else None


class WorkerRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **routing) -> None:
        """`routing`: the model's `routing` config (serve_app/app.py passes it)."""
        self._prefixes = PrefixRouting(PrefixRoutingOptions(**routing))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pinned = pending_request.kwargs.get(PIN_KEYWORD) if pending_request is not None else None
        if pinned is None:
            return await self._choose_by_prefix(candidate_replicas, pending_request)
        # No other replica will do: an empty answer makes Serve retry (the replica may be
        # full for a moment) until the caller gives up (it cancels once the replica is gone).
        # Serve retries without sleeping unless told to back off: a pinned call to a dead
        # replica would otherwise spin the router's loop and stall every other call.
        pending_request.routing_context.should_backoff = True
        return [[r for r in candidate_replicas if replica_key(r) == pinned]]

    async def _choose_by_prefix(self, candidates: list[RunningReplica],
                                pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        by_load = await super().choose_replicas(candidates, pending_request)
        request = generate_request(pending_request)
        # An adapter's requests follow Serve's multiplexing to replicas holding it (super()).
        if request is None or not self._prefixes.options.prefix_aware or request.lora is not None:
            return by_load
        loads = await self._ongoing_requests(candidates)
        target = self._prefixes.preferred(request, self._prefixes.keys(request), loads)
        if target is None:
            return by_load
        # The preferred replica first; the load-only choice if it turns the request down (full).
        return [[r for r in candidates if replica_key(r) == target], *by_load]

    async def _ongoing_requests(self, candidates: list[RunningReplica]) -> dict[str, int]:
        """Each candidate's ongoing requests: Serve's cached queue lengths, probed where
        missing or stale (a probe that fails leaves the replica out)."""
        loads, unknown = {}, []
        for replica in candidates:
            queue_len = self._replica_queue_len_cache.get(replica.replica_id)
            if queue_len is None:
                unknown.append(replica)
            else:
                loads[replica_key(replica)] = queue_len
        for replica, queue_len in await self._probe_queue_lens(unknown, 0) if unknown else ():
            if queue_len is not None:
                loads[replica_key(replica)] = queue_len
        return loads

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        request = generate_request(pending_request)
        if request is not None and self._prefixes.options.prefix_aware and request.lora is None:
            self._prefixes.routed(self._prefixes.keys(request), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id) -> None:
        # Serve drops a dead replica here, long before the controller's next update:
        # tell the channels now, so its requests move on and its channel stops reopening.
        super().on_replica_actor_died(replica_id)
        self._publish()

    def _publish(self) -> None:
        ReplicaDirectory.publish(deployment_key(self._deployment_id.app_name, self._deployment_id.name),
                                 frozenset(replica_key(r) for r in self._replicas.values()))
