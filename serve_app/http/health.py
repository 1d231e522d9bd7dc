"""`GET /health` for load balancers and Kubernetes probes: 200 while every model has a ready
worker replica, 503 (naming the models) while one has none. A model whose autoscaling may go
to zero replicas counts as ready with none: its first request starts one, and a 503 would
keep a load balancer from ever sending that request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelHealth:
    ready_replicas: int  # worker replicas the ingress's router sees running now
    scales_to_zero: bool  # autoscaling min_replicas 0

    @property
    def ready(self) -> bool:
        return self.ready_replicas > 0 or self.scales_to_zero


def health_report(models: dict[str, ModelHealth]) -> tuple[int, dict]:
    """The status code and body: {"status": "ok" | "unavailable", "models": {id: {...}}}."""
    body = {"status": "ok" if all(m.ready for m in models.values()) else "unavailable",
            "models": {model_id: {"ready_replicas": m.ready_replicas, "ready": m.ready}
                       for model_id, m in models.items()}}
    return (200 if body["status"] == "ok" else 503), body
