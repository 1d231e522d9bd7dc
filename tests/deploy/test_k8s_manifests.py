"""The KubeRay manifests (k8s/rayservice-*.yaml) against the RayService CRD schema, and
their serveConfigV2 against configs/*.yaml (one source of truth). Files only, no cluster."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from serve_app.config.app_config import parse_app_config
from serve_app.config.placement import placement_problem
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
CRD_DIR = ROOT.parent / "shared" / "k8s-crds"
if not CRD_DIR.is_dir():  # the shared checkout sits beside the repository, or inside it
    CRD_DIR = ROOT / "shared" / "k8s-crds"
RAYSERVICE_CRD = CRD_DIR / "ray.io_rayservices.yaml"

# manifest -> the serve config its serveConfigV2 must equal
MANIFESTS = {
    "rayservice-cpu.yaml": "default.yaml",
    "rayservice-gpu.yaml": "gpu.yaml",
    "rayservice-gpu-tp2.yaml": "gpu-tp2.yaml",
}
# What Ray Serve uses when a key is absent (ray.serve.schema.ServeDeploySchema); KubeRay's
# Serve Service targets port 8000 of each pod, so these must hold for the k8s configs.
SERVE_DEFAULTS = {"proxy_location": "EveryNode", "http_options": {"host": "0.0.0.0", "port": 8000}}
# Where a config differs from those on purpose: configs/default.yaml is `make serve` on one
# machine and binds loopback (its manifest leaves http_options out, so the pods still get
# SERVE_DEFAULTS' 0.0.0.0, which KubeRay's Service needs).
LOOPBACK_ONLY = {"default.yaml": {"http_options": {"host": "127.0.0.1", "port": 8000}}}

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is 1 MB: C loader, ~10x faster


def _load(path: Path):
    with path.open() as f:
        return yaml.load(f, Loader=_Loader)  # noqa: S506 - a SafeLoader


@pytest.fixture(scope="session")
def rayservice_schema() -> dict:
    if not RAYSERVICE_CRD.is_file():
        pytest.skip(f"KubeRay CRD not found at {RAYSERVICE_CRD}")
    crd = _load(RAYSERVICE_CRD)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "RayService"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="session")
def validator(rayservice_schema):
    # Draft 7 ignores the Kubernetes extension keywords (x-kubernetes-*) as unknown ones.
    jsonschema.Draft7Validator.check_schema(rayservice_schema)
    return jsonschema.Draft7Validator(rayservice_schema)


def manifest(name: str) -> dict:
    return _load(ROOT / "k8s" / name)


def errors(validator, doc) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_is_a_valid_rayservice(validator, name):
    doc = manifest(name)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    assert errors(validator, doc) == []
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    assert cluster["headGroupSpec"]["rayStartParams"]
    assert cluster["workerGroupSpecs"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        for container in pod["spec"]["containers"]:
            assert container["image"].split("/")[-1].startswith("chatserve:")
    head_ports = {p["name"]: p["containerPort"] for p in pods[0]["spec"]["containers"][0]["ports"]}
    assert head_ports["serve"] == 8000


@pytest.mark.parametrize(("name", "config_name"), MANIFESTS.items())
def test_serve_config_v2_equals_the_serve_config(name, config_name):
    """One source of truth: edit configs/<x>.yaml, copy its `applications:` block here."""
    serve_config = _load(ROOT / "configs" / config_name)
    in_manifest = yaml.safe_load(manifest(name)["spec"]["serveConfigV2"])
    assert in_manifest == {"applications": serve_config["applications"]}, (
        f"k8s/{name} serveConfigV2 differs from configs/{config_name}: copy its applications: block"
    )
    # What serveConfigV2 leaves out must be Serve's defaults, which KubeRay relies on (but
    # for a loopback host where the config is for one machine only).
    rest = {k: v for k, v in serve_config.items() if k != "applications"}
    assert rest == {**SERVE_DEFAULTS, **LOOPBACK_ONLY.get(config_name, {})}
    parse_app_config(in_manifest["applications"][0]["args"])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's own pydantic v1-style fields
def test_serve_defaults_are_what_a_manifest_gets():
    """A serveConfigV2 without proxy_location and http_options: Ray Serve's schema fills in
    SERVE_DEFAULTS, so the pods listen on 0.0.0.0:8000 with a proxy on each."""
    from ray.serve.schema import ServeDeploySchema

    for name in MANIFESTS:
        config = ServeDeploySchema.model_validate(yaml.safe_load(manifest(name)["spec"]["serveConfigV2"]))
        http = config.http_options
        assert {"proxy_location": config.proxy_location.value,
                "http_options": {"host": http.host, "port": http.port}} == SERVE_DEFAULTS, name


def test_gpu_manifest_requests_gpus_and_autoscales():
    cluster = manifest("rayservice-gpu.yaml")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    gpu_groups = [
        g for g in cluster["workerGroupSpecs"]
        if any(c["resources"]["limits"].get("nvidia.com/gpu") == 1 for c in g["template"]["spec"]["containers"])
    ]
    assert len(gpu_groups) == 1
    (group,) = gpu_groups
    # The pods can hold every model replica the Serve autoscaler may ask for.
    args = yaml.safe_load(manifest("rayservice-gpu.yaml")["spec"]["serveConfigV2"])["applications"][0]["args"]
    (model,) = parse_app_config(args).models
    assert group["maxReplicas"] >= model.deployment.autoscaling_config.max_replicas
    assert group["minReplicas"] >= 1
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head.get("resources", {}).get("limits", {})


def test_tensor_parallel_manifest_pods_each_hold_a_whole_replica():
    """STRICT_PACK puts all of a replica's shards on one node: a GPU pod must have at least
    as many GPUs (and CPUs) as the replica's placement-group bundles, or no replica is placed."""
    cluster = manifest("rayservice-gpu-tp2.yaml")["spec"]["rayClusterConfig"]
    args = yaml.safe_load(manifest("rayservice-gpu-tp2.yaml")["spec"]["serveConfigV2"])["applications"][0]["args"]
    (model,) = parse_app_config(args).models
    assert model.parallel.tensor_parallel_size == 2
    options = model.worker_serve_options()
    assert options["placement_group_strategy"] == "STRICT_PACK"
    need = {key: sum(b.get(key, 0) for b in options["placement_group_bundles"]) for key in ("CPU", "GPU")}
    assert need["GPU"] == 2
    gpu_groups = [
        g for g in cluster["workerGroupSpecs"]
        if any("nvidia.com/gpu" in c["resources"]["limits"] for c in g["template"]["spec"]["containers"])
    ]
    assert gpu_groups
    for group in gpu_groups:
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        node = {"GPU": float(limits["nvidia.com/gpu"]), "CPU": float(limits["cpu"])}
        assert node["GPU"] >= need["GPU"] and node["CPU"] >= need["CPU"], group["groupName"]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
        # Ray takes the pod's GPUs from the limit unless rayStartParams overrides it.
        assert group["rayStartParams"].get("num-gpus", str(limits["nvidia.com/gpu"])) == str(limits["nvidia.com/gpu"])
        assert placement_problem(model, [node]) is None  # the check the app runs at start
        assert group["maxReplicas"] >= model.deployment.autoscaling_config.max_replicas


def test_cpu_manifest_requests_no_gpu():
    cluster = manifest("rayservice-cpu.yaml")["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:
        for container in group["template"]["spec"]["containers"]:
            assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


@pytest.mark.parametrize(
    ("break_it", "where"),
    [
        (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(replicas="two"),
         "spec.rayClusterConfig.workerGroupSpecs.0.replicas"),
        (lambda d: d["spec"].update(serveConfigV2={"applications": []}), "spec.serveConfigV2"),
        (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"),
         "spec.rayClusterConfig.workerGroupSpecs.0"),
        (lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),
         "spec.rayClusterConfig.headGroupSpec.rayStartParams.num-cpus"),
    ],
    ids=["replicas-not-int", "serveConfigV2-not-string", "groupName-missing", "rayStartParam-not-string"],
)
def test_validation_catches_a_broken_manifest(validator, break_it, where):
    doc = copy.deepcopy(manifest("rayservice-cpu.yaml"))
    break_it(doc)
    found = errors(validator, doc)
    assert any(e.startswith(where + ":") for e in found), found


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_every_ray_container_runs_ray_as_make_serve_does(name):
    from tools.bench.compare import SERVE_ENV

    doc = manifest(name)["spec"]["rayClusterConfig"]
    groups = [doc["headGroupSpec"], *doc["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {item["name"]: item["value"] for item in container.get("env", [])}
            assert env.items() >= SERVE_ENV.items(), (name, container["name"])
