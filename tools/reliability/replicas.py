"""Serve replicas for the reliability runs: more worker replicas in an app's args, and killing one under load.

Shared by tools/reliability/faults.py (one kill per fault) and tools/reliability/soak.py
(`--kill-worker-every`: a kill every S seconds through the whole soak). The driver must be
attached to the Ray cluster that runs the app.
"""

from __future__ import annotations

import copy
import time


def with_worker_replicas(args: dict, worker_replicas: int) -> dict:
    """A copy of the app's args with `worker_replicas` replicas of the first model, each
    given one torch thread and half a CPU: two replicas then fit a 2-core machine without
    oversubscribing it (each would otherwise spawn a thread per core and ask Ray for a whole
    CPU, so the second one, or a replacement, could not be scheduled beside the ingress)."""
    args = copy.deepcopy(args)
    model = args["models"][0]
    model.setdefault("deployment", {})["num_replicas"] = worker_replicas
    model["deployment"].setdefault("ray_actor_options", {})["num_cpus"] = 0.5
    model.setdefault("engine", {})["torch_threads"] = 1
    return args


def worker_replicas_of(args: dict) -> int:
    """The first model's `deployment.num_replicas` (Serve's default: 1)."""
    return int(args["models"][0].get("deployment", {}).get("num_replicas", 1))


def replica_actor_names(app_name: str, deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def kill_replica(app_name: str, deployment: str) -> str:
    """Kill one replica of `deployment` with no restart; returns its actor name."""
    import ray

    names = replica_actor_names(app_name, deployment)
    if not names:
        raise RuntimeError(f"no replica of {app_name}#{deployment}")
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


def running_replicas(app_name: str, deployment: str) -> tuple[int, int]:
    """(RUNNING replicas, replicas in any state) of a deployment, as Serve reports them."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    states = app.deployments[deployment].replica_states if app and deployment in app.deployments else {}
    return states.get("RUNNING", 0), sum(states.values())


def wait_replaced(app_name: str, deployment: str, killed: str, replicas: int, since: float,
                  timeout_s: float) -> float | None:
    """Seconds from `since` until the deployment has `replicas` RUNNING replicas again, none
    of them the `killed` actor (Serve may still count it RUNNING before it notices)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = replica_actor_names(app_name, deployment)
        if killed not in names and len(names) == replicas and \
                running_replicas(app_name, deployment) == (replicas, replicas):
            return round(time.monotonic() - since, 1)
        time.sleep(0.25)
    return None


def wait_all_running(app_name: str, deployment: str, replicas: int, timeout_s: float) -> None:
    """Before the load: every replica up (a fresh app answers while its second replica starts)."""
    deadline = time.monotonic() + timeout_s
    while running_replicas(app_name, deployment) != (replicas, replicas):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{deployment}: {running_replicas(app_name, deployment)} replicas running")
        time.sleep(0.5)
