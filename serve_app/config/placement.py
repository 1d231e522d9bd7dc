"""Whether the cluster can ever hold a split model's replica: one whose shards ask
for more than any node (STRICT_PACK) or the whole cluster has is a config error at
start, named by its field, instead of a replica Serve waits for forever."""

from __future__ import annotations

from workers.contract.model_config import ModelConfig


def placement_problem(model: ModelConfig, nodes: list[dict[str, float]]) -> str | None:
    """Why no replica of `model` can be placed on `nodes` (each node's total resources), or None."""
    options = model.worker_serve_options()
    bundles = options.get("placement_group_bundles")
    if not bundles or not nodes:
        return None
    need = {key: sum(bundle.get(key, 0) for bundle in bundles) for key in ("CPU", "GPU")}
    strict = model.parallel.placement_group_strategy == "STRICT_PACK"
    pools = nodes if strict else [{key: sum(node.get(key, 0) for node in nodes) for key in need}]
    if any(all(pool.get(key, 0) >= amount for key, amount in need.items()) for pool in pools):
        return None
    where = "any one node" if strict else "the cluster"
    largest = max(pools, key=lambda pool: (pool.get("GPU", 0), pool.get("CPU", 0)))
    return (f"parallel.{model.parallel.split_field}: {len(bundles)} shards need {need['GPU']:g} GPUs and {need['CPU']:g} CPUs "
            f"({model.parallel.placement_group_strategy}), more than {where} has "
            f"({largest.get('GPU', 0):g} GPUs, {largest.get('CPU', 0):g} CPUs)")


def cluster_nodes() -> list[dict[str, float]]:
    """The alive nodes' total resources, when this process is connected to Ray (else none: no check)."""
    import ray

    if not ray.is_initialized():
        return []
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]
