"""The request router of every model-worker deployment (Ray Serve's request-router API).

Requests are routed as Serve's default router routes them (power of two choices among
replicas with room), with one addition: a call that names a replica (`replica=` keyword,
the ingress's channel opens) goes to that replica and no other. The router runs inside
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
from ray.serve.request_router import PendingRequest, RunningReplica

from serve_app.transport.replica_directory import (
    PIN_KEYWORD,
    ReplicaDirectory,
    deployment_key,
)

ROUTER_CLASS = "serve_app.transport.router:WorkerRouter"


def replica_key(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


class WorkerRouter(PowerOfTwoChoicesRequestRouter):
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pinned = pending_request.kwargs.get(PIN_KEYWORD) if pending_request is not None else None
        if pinned is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        # No other replica will do: an empty answer makes Serve retry (the replica may be
        # full for a moment) until the caller gives up (it cancels once the replica is gone).
        # Serve retries without sleeping unless told to back off: a pinned call to a dead
        # replica would otherwise spin the router's loop and stall every other call.
        pending_request.routing_context.should_backoff = True
        return [[r for r in candidate_replicas if replica_key(r) == pinned]]

    def on_replica_actor_died(self, replica_id) -> None:
        # Serve drops a dead replica here, long before the controller's next update:
        # tell the channels now, so its requests move on and its channel stops reopening.
        super().on_replica_actor_died(replica_id)
        self._publish()

    def _publish(self) -> None:
        ReplicaDirectory.publish(deployment_key(self._deployment_id.app_name, self._deployment_id.name),
                                 frozenset(replica_key(r) for r in self._replicas.values()))
