"""The worker's default torch threads (workers/serving/cpu_budget.py): the cgroup CPU quota,
rounded up, at least 1, at most the affinity mask; fake cgroup files in a tmp dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT
from workers.serving.cpu_budget import affinity_cpus, cgroup_cpu_quota, cpu_budget


def cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


@pytest.mark.parametrize(("cpu_max", "quota", "budget"), [
    ("200000 100000", (200000, 100000), 2),
    ("150000 100000", (150000, 100000), 2),  # 1.5 CPUs: rounded up
    ("50000 100000", (50000, 100000), 1),  # half a CPU: still one thread
    ("100000000 100000", (100000000, 100000), 8),  # a quota above the affinity mask: capped
])
def test_cgroup_v2_quota(tmp_path, cpu_max, quota, budget):
    root = cgroup(tmp_path, {"cpu.max": cpu_max})
    assert cgroup_cpu_quota(root) == quota
    assert cpu_budget(root, affinity=8) == budget


def test_cgroup_v2_max_means_no_quota(tmp_path):
    root = cgroup(tmp_path, {"cpu.max": "max 100000"})
    assert cgroup_cpu_quota(root) is None
    assert cpu_budget(root, affinity=6) == 6


@pytest.mark.parametrize("cpu_dir", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_quota(tmp_path, cpu_dir):
    root = cgroup(tmp_path, {f"{cpu_dir}/cpu.cfs_quota_us": "250000", f"{cpu_dir}/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(root) == (250000, 100000)
    assert cpu_budget(root, affinity=16) == 3
    assert cpu_budget(root, affinity=2) == 2


def test_cgroup_v1_without_quota(tmp_path):
    root = cgroup(tmp_path, {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(root) is None
    assert cpu_budget(root, affinity=4) == 4


def test_no_cgroup_files(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None
    assert cpu_budget(tmp_path, affinity=5) == 5
    assert cpu_budget(tmp_path, affinity=0) == 1


def test_unreadable_or_garbled_quota_is_no_quota(tmp_path):
    assert cgroup_cpu_quota(cgroup(tmp_path / "a", {"cpu.max": ""})) is None
    assert cgroup_cpu_quota(cgroup(tmp_path / "b", {"cpu.max": "lots 100000"})) is None
    assert cgroup_cpu_quota(cgroup(tmp_path / "c", {"cpu.max": "100000 0"})) is None


def test_the_default_affinity_is_this_processs_mask(tmp_path):
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert affinity_cpus() == expected
    assert cpu_budget(tmp_path) == expected  # no quota files under tmp_path


def test_the_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, workers.serving.cpu_budget; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("configured", "expected"), [(None, 3), (2, 2)])
def test_the_worker_sets_torch_threads_from_the_budget_unless_configured(monkeypatch, configured, expected):
    import torch

    from workers.contract.model_config import ModelConfig
    from workers.serving import model_part

    monkeypatch.setattr(model_part, "cpu_budget", lambda: 3)
    config = ModelConfig(id="m", source="/models/m", device="cpu", engine={"torch_threads": configured})
    previous = torch.get_num_threads()
    try:
        model_part.set_torch_threads(config)
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(previous)
