"""A split model's other shards (workers/parallel/) as Ray actors in the worker replica's
placement group: shard r takes bundle r (the replica itself is shard 0, in bundle 0).

Each shard loads the model on the thread that will run it (the reason is in
AsyncEngine.start_on_own_thread), keeps its part, joins the replica's group and then
runs the steps the driver sends. Its load time and peak memory are logged. The replica's
health check asks every shard whether it still runs: a dead shard fails the check, and
Serve replaces the whole replica (its requests resume elsewhere); a shard that dies
mid-step fails that step on the driver too (gloo sees the peer go).
"""

from __future__ import annotations

import logging
import resource
import threading
import time

import ray
import torch
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.contract.model_config import ModelConfig
from workers.contract.serve_logs import route_to_serve_log
from workers.parallel.shard_group import ShardGroup
from workers.parallel.shard_loop import ShardLoop

logger = logging.getLogger(__name__)


@ray.remote
class ShardActor:
    def __init__(self, model_config: dict, shard: int, init_method: str) -> None:
        route_to_serve_log(logging.getLogger("workers"))
        self._error: str | None = None
        self._loop: ShardLoop | None = None
        config = ModelConfig.model_validate(model_config)
        self._thread = threading.Thread(target=self._run, args=(config, shard, init_method),
                                        name=f"chatserve-shard-{shard}", daemon=True)
        self._thread.start()

    def _run(self, config: ModelConfig, shard: int, init_method: str) -> None:
        from workers.serving.model_part import (  # torch and the model code, in the actor only
            load_part,
            shard_layout,
        )

        try:
            started = time.monotonic()
            loaded, stage = load_part(config, shard)
            device = torch.device(config.device)
            layout = shard_layout(config)
            self._loop = ShardLoop(loaded.model, ShardGroup(shard, layout, init_method, device), device, stage)
            logger.info("shard %d of %d of %s ready in %.1f s, peak RSS %.0f MiB", shard, layout.world,
                        config.id, time.monotonic() - started, peak_rss_mib())
            self._loop.run()
            self._error = "the driver stopped the shard"
        except BaseException as exc:  # noqa: BLE001 - reported by alive(), which fails the replica's health check
            logger.exception("shard %d of %s failed", shard, config.id)
            self._error = f"{type(exc).__name__}: {exc}"

    def alive(self) -> str | None:
        """None while the shard runs (or is loading); else why it stopped."""
        if self._error is None and not self._thread.is_alive():
            return "the shard's thread ended"
        return self._error


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def start_shards(config: ModelConfig, init_method: str) -> list[ray.actor.ActorHandle]:
    """Shards 1..world-1, each in its bundle of this replica's placement group (or placed
    by Ray where the replica has none, e.g. a test's plain actor), with that bundle's
    resources."""
    world = config.parallel.shards
    group = get_current_placement_group()
    resources = {"num_cpus": config.worker_serve_options()["ray_actor_options"]["num_cpus"]}
    if config.device == "cuda":
        resources["num_gpus"] = 1
    shards = []
    for rank in range(1, world):
        options = dict(resources)
        if group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
        shards.append(ShardActor.options(**options).remote(config.model_dump(), rank, init_method))
    return shards
