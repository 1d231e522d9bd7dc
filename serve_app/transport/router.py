"""The request router of every model-worker deployment (Ray Serve's request-router API).

Requests are routed as Serve's default router routes them (power of two choices among
replicas with room), with one addition: a call that names a replica (`replica=` keyword,
the ingress's channel opens) goes to that replica and no other. The router runs inside
each caller's process; it publishes the replica set it sees to that process's
`ReplicaDirectory`, so the ingress's channels follow replicas as they come and go.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ray.serve._private.request_router.pow_2_router import (
    PowerOfTwoChoicesRequestRouter,
)
from ray.serve.request_router import PendingRequest, RunningReplica

ROUTER_CLASS = "serve_app.transport.router:WorkerRouter"
PIN_KEYWORD = "replica"  # a call's keyword argument naming the replica it must go to

Listener = Callable[[frozenset[str]], None]


class ReplicaDirectory:
    """Per process: the replicas each deployment's router knows, and who wants to hear of
    changes. Routers run on Serve's router loop (a thread of its own by default), listeners
    on an ingress's loop: a listener must hop to its loop itself."""

    _lock = threading.Lock()
    _replicas: dict[str, frozenset[str]] = {}
    _listeners: dict[str, list[Listener]] = {}

    @classmethod
    def publish(cls, deployment: str, replica_ids: frozenset[str]) -> None:
        with cls._lock:
            cls._replicas[deployment] = replica_ids
            listeners = list(cls._listeners.get(deployment, ()))
        for listener in listeners:
            listener(replica_ids)

    @classmethod
    def subscribe(cls, deployment: str, listener: Listener) -> None:
        """Call `listener` now with the replicas known (if any), then on every change."""
        with cls._lock:
            cls._listeners.setdefault(deployment, []).append(listener)
            known = cls._replicas.get(deployment)
        if known is not None:
            listener(known)

    @classmethod
    def unsubscribe(cls, deployment: str, listener: Listener) -> None:
        with cls._lock:
            listeners = cls._listeners.get(deployment, [])
            if listener in listeners:
                listeners.remove(listener)


def deployment_key(app_name: str, deployment_name: str) -> str:
    return f"{app_name}/{deployment_name}"


def replica_key(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


class WorkerRouter(PowerOfTwoChoicesRequestRouter):
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ReplicaDirectory.publish(deployment_key(self._deployment_id.app_name, self._deployment_id.name),
                                 frozenset(replica_key(r) for r in replicas))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pinned = pending_request.kwargs.get(PIN_KEYWORD) if pending_request is not None else None
        if pinned is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        # No other replica will do: an empty answer makes Serve retry (the replica may be
        # full for a moment) until the caller gives up (it cancels once the replica is gone).
        return [[r for r in candidate_replicas if replica_key(r) == pinned]]
