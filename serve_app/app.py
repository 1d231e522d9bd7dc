"""`serve run` entry point: `import_path: serve_app.app:build_app`, models in `args`."""

from __future__ import annotations

import re
from typing import Any

from ray.serve import Application

from serve_app.app_config import parse_app_config
from serve_app.ingress import ChatIngress
from serve_app.lora_registry import LoraRegistry
from workers.serving.deployment import ModelWorker


def worker_deployment_name(model_id: str) -> str:
    return "ModelWorker-" + re.sub(r"[^A-Za-z0-9_.-]", "-", model_id)


def build_app(args: dict[str, Any]) -> Application:
    """Validate the config (a bad key fails here, named) and bind ingress + one worker per
    model (+ the LoRA registry when a model serves adapters)."""
    config = parse_app_config(args)
    workers = {
        model.id: ModelWorker.options(
            name=worker_deployment_name(model.id), **model.deployment.serve_options()
        ).bind(model.model_dump())
        for model in config.models
    }
    registry = LoraRegistry.bind() if any(m.lora is not None for m in config.models) else None
    return ChatIngress.options(**config.ingress.serve_options()).bind(config.model_dump(), workers, registry)
