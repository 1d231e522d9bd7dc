"""LoRA adapters at the ingress: which served model a request's `model` names (a base model
or an adapter of one), the load and unload routes' rules, and the registry of adapters loaded
at run time.

Adapters come from two places: the config (`lora.adapters` of a model: permanent, known
to every replica from the config) and run-time loads, kept in the app's `LoraRegistry`
deployment (below). `AdapterCatalog.resolve` is the ingress's one adapter check; the
files are checked by a worker replica (`check_lora_adapter`) when an adapter is loaded.
An adapter's `LoraRequest` travels in the worker request; its key is the call's
`multiplexed_model_id`, which routes it to a worker replica that holds the adapter
(serve_app/transport/worker_call.py).

`LoraRegistry` is a small Serve deployment with one replica, bound in the app only when a
model serves LoRA adapters. `POST /v1/load_lora_adapter` on any ingress replica registers
an adapter there and `/v1/unload_lora_adapter` removes it; a request naming an adapter the
config does not list is resolved there, so every replica agrees at once. Adapters named in
the config are not kept there: every replica reads them from the config. The registry lives
in its replica's memory: if Serve replaces that replica, adapters loaded at run time must
be loaded again (as a restarted vLLM server forgets them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config.app_config import AppConfig
from serve_app.http.errors import APIError, not_found_model
from workers.contract.lora import LoraAdapterError, LoraRequest, adapter_path_inside
from workers.contract.model_config import check_adapter_name


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's fields, and `base_model` when several models serve adapters)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model: str | None = None


class UnloadLoraAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's clients may send it; names are what identify adapters here


@dataclass(frozen=True)
class RegisteredAdapter:
    base_model: str  # the id of the model it adapts
    request: LoraRequest


@dataclass(frozen=True)
class Target:
    """What a request's `model` names: a served model (by its config id), with one of its
    adapters or none."""

    base_model: str
    lora: LoraRequest | None = None


class AdapterCatalog:
    def __init__(self, config: AppConfig, registry: DeploymentHandle | None) -> None:
        """`registry`: the app's LoraRegistry (None when no model serves adapters)."""
        self.config = config
        self.registry = registry
        self.configured: dict[str, Target] = {
            name: Target(model.id, LoraRequest.of(name, path))
            for model in config.models if model.lora is not None
            for name, path in model.lora.adapters.items()
        }

    async def resolve(self, model: str) -> Target:
        """The target of `model`, or a 404 naming what is served."""
        if (served := self.config.served(model)) is not None:
            return Target(served.id)
        if (target := self.configured.get(model)) is not None:
            return target
        entry: RegisteredAdapter | None = await self.registry.get.remote(model) if self.registry else None
        if entry is None:
            raise not_found_model(model, self.config.served_names() + list(self.configured))
        return Target(entry.base_model, entry.request)

    async def registered(self) -> list[RegisteredAdapter]:
        """Every adapter served: the config's, then those loaded at run time."""
        configured = [RegisteredAdapter(t.base_model, t.lora) for t in self.configured.values()]
        return configured + (await self.registry.all.remote() if self.registry else [])

    def load_target(self, req: LoadLoraAdapterRequest) -> tuple[str, str]:
        """(base model id, resolved path) of a load, or the 400 / 404 that refuses it."""
        try:
            check_adapter_name(req.lora_name)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_name") from None
        if self.config.served(req.lora_name) is not None or req.lora_name in self.configured:
            raise APIError(400, f"the name {req.lora_name!r} is already a served model", param="lora_name")
        base = self._base_model(req.base_model)
        try:
            path = adapter_path_inside(self.config.model(base).lora.adapter_dir, req.lora_path)
        except LoraAdapterError as exc:
            raise APIError(400, f"LoRA adapter {req.lora_name!r}: {exc}", param="lora_path",
                           code="invalid_lora_adapter") from None
        return base, str(path)

    async def register(self, name: str, base: str, path: str) -> None:
        if await self.registry.register.remote(name, base, path) is None:
            raise APIError(400, f"the LoRA adapter {name!r} is already loaded", param="lora_name")

    async def unregister(self, req: UnloadLoraAdapterRequest) -> None:
        if req.lora_name in self.configured:
            raise APIError(400, f"the LoRA adapter {req.lora_name!r} comes from the config and cannot be unloaded",
                           param="lora_name")
        if self.registry is None or await self.registry.unregister.remote(req.lora_name) is None:
            raise APIError(404, f"the LoRA adapter {req.lora_name!r} cannot be found", param="lora_name",
                           code="lora_adapter_not_found")

    def _base_model(self, requested: str | None) -> str:
        with_lora = [m.id for m in self.config.models if m.lora is not None]
        if requested is None:
            if len(with_lora) != 1:
                names = [self.config.model(i).names[0] for i in with_lora]
                raise APIError(400, f"base_model is required: the models that serve LoRA adapters are {names}",
                               param="base_model")
            return with_lora[0]
        if (served := self.config.served(requested)) is None:
            raise not_found_model(requested, self.config.served_names())
        if served.id not in with_lora:
            raise APIError(400, f"the model {requested!r} serves no LoRA adapters (its config has no `lora`)",
                           param="base_model")
        return served.id


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
