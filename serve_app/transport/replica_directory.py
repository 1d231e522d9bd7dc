"""Per process: the worker replicas each deployment's router knows, for the ingress's channels.

The router (serve_app/transport/router.py) publishes here from Serve's router loop (a
thread of its own by default); the channels (serve_app/transport/channels.py) listen on
the ingress's loop, so a listener must hop to its loop itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

PIN_KEYWORD = "replica"  # a call's keyword argument naming the replica it must go to

Listener = Callable[[frozenset[str]], None]


def deployment_key(app_name: str, deployment_name: str) -> str:
    return f"{app_name}/{deployment_name}"


class ReplicaDirectory:
    """The replicas each deployment's router knows, and who wants to hear of changes."""

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
