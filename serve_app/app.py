"""`serve run` entry point: `import_path: serve_app.app:build_app`, models in `args`."""

from __future__ import annotations

import re
from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from serve_app.config.app_config import AppConfig, ConfigError, parse_app_config
from serve_app.config.placement import cluster_nodes, placement_problem
from serve_app.ingress import ChatIngress
from serve_app.lora.adapters import LoraRegistry
from serve_app.transport.router import ROUTER_CLASS
from workers.contract.model_config import ModelConfig, pooling_conflict
from workers.contract.model_shape import local_split_problem
from workers.model.model_kind import resolved_runner
from workers.serving.deployment import ModelWorker
from workers.serving.encoder_worker import EncoderWorker


def worker_deployment_name(model_id: str, side: str = "decode") -> str:
    """The model's worker deployment (with disaggregation, the decode side's: the one that
    streams, serves /tokenize and is read for stats); `side="prefill"`: its prefill side's."""
    name = "ModelWorker-" + re.sub(r"[^A-Za-z0-9_.-]", "-", model_id)
    return name + "-prefill" if side == "prefill" else name


def build_app(args: dict[str, Any]) -> Application:
    """Validate the config (a bad key fails here, named) and bind ingress + one worker per
    model (two for a disaggregated model: the decode side is given the prefill side's
    handle) + the LoRA registry when a model serves adapters."""
    config = resolve_runners(parse_app_config(args))
    check_placement(config, cluster_nodes())
    workers, prefills = {}, {}
    tracing = config.server.tracing.model_dump() if config.server.tracing.enabled else None
    for model in config.models:
        if model.disaggregation is not None:
            prefills[model.id] = worker_deployment(model, config, "prefill").bind(model.model_dump(), None, "prefill",
                                                                                  tracing)
        side = "decode" if model.disaggregation is not None else "colocated"
        workers[model.id] = worker_deployment(model, config).bind(model.model_dump(), prefills.get(model.id), side,
                                                                  tracing)
    registry = LoraRegistry.bind() if any(m.lora is not None for m in config.models) else None
    return ChatIngress.options(**config.ingress.serve_options()).bind(config.model_dump(), workers, registry,
                                                                      prefills)


def resolve_runners(config: AppConfig) -> AppConfig:
    """Each model's `runner: auto` decided from its checkpoint's config (an encoder pools,
    workers/model/model_kind.py); a ConfigError when an encoder's config asks for what it
    cannot serve."""
    models = []
    for index, model in enumerate(config.models):
        runner = resolved_runner(model.runner, model.source)
        if runner == "pooling" and (conflict := pooling_conflict(model)) is not None:
            raise ConfigError(f"invalid chatserve config: models.{index}.runner: {model.source!r} is an encoder "
                              f"(runner pooling): {conflict}")
        models.append(model.model_copy(update={"runner": runner}))
    return config.model_copy(update={"models": models})


def check_placement(config: AppConfig, nodes: list[dict[str, float]]) -> None:
    """Raise ConfigError when a model's split cannot divide its local checkpoint, or its
    replica cannot fit the cluster (serve_app/config/placement.py)."""
    for index, model in enumerate(config.models):
        tp, stages = model.parallel.tensor_parallel_size, model.parallel.pipeline_parallel_size
        split = local_split_problem(model.source, tp, stages)
        problem = f"parallel.{split[0]}: {split[1]}" if split else placement_problem(model, nodes)
        if problem is not None:
            raise ConfigError(f"invalid chatserve config: models.{index}.{problem}")


def worker_deployment(model: ModelConfig, config: AppConfig, side: str = "decode"):
    """The model's worker deployment (`side` of a disaggregated one): its Serve options, its
    router (serve_app/transport/router.py), and room for one channel per ingress replica
    beside `max_ongoing_requests` (a channel is an open call, and Serve counts it)."""
    options = model.worker_serve_options(side)
    options["max_ongoing_requests"] += config.ingress.max_replicas
    router = RequestRouterConfig(request_router_class=ROUTER_CLASS, request_router_kwargs=model.routing.model_dump())
    worker_class = EncoderWorker if model.runner == "pooling" else ModelWorker
    return worker_class.options(name=worker_deployment_name(model.id, side), **options, request_router_config=router)
