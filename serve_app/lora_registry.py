"""The adapters loaded at run time, in one place every ingress replica asks.

A small Serve deployment with one replica, bound in the app only when a model serves LoRA
adapters. `POST /v1/load_lora_adapter` on any ingress replica registers an adapter here and
`/v1/unload_lora_adapter` removes it; a request naming an adapter the config does not list
is resolved here, so every replica agrees at once. Adapters named in the config are not
kept here: every replica reads them from the config. The registry lives in its replica's
memory: if Serve replaces that replica, adapters loaded at run time must be loaded again
(as a restarted vLLM server forgets them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ray import serve

from workers.contract.lora import LoraRequest


@dataclass(frozen=True)
class RegisteredAdapter:
    base_model: str  # the served model id it adapts
    request: LoraRequest


@serve.deployment(name="LoraRegistry", num_replicas=1, ray_actor_options={"num_cpus": 0})
class LoraRegistry:
    def __init__(self) -> None:
        self._adapters: dict[str, RegisteredAdapter] = {}
        self._loads = itertools.count(1)  # a load's generation: a reloaded name gets a new key

    def register(self, name: str, base_model: str, path: str) -> RegisteredAdapter | None:
        """The new entry; None when `name` is registered already."""
        if name in self._adapters:
            return None
        entry = RegisteredAdapter(base_model, LoraRequest.of(name, path, f"load-{next(self._loads)}"))
        self._adapters[name] = entry
        return entry

    def unregister(self, name: str) -> RegisteredAdapter | None:
        return self._adapters.pop(name, None)

    def get(self, name: str) -> RegisteredAdapter | None:
        return self._adapters.get(name)

    def all(self) -> list[RegisteredAdapter]:
        return list(self._adapters.values())
