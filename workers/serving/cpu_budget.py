"""How many CPUs this process may use: the container's CPU quota, not the node's cores.

The quota is cgroup v2's `cpu.max` ("<quota> <period>", or "max <period>" for none) or
cgroup v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us` (a quota of -1 for none), read from
the process's cgroup as a container sees it (/sys/fs/cgroup). The budget is the quota
rounded up (1.5 CPUs: 2 threads), at least 1, and never more than the CPUs the process
may run on (its affinity mask). No quota, or none readable: the affinity mask alone.
No torch here: the worker's engine build sets torch's threads from it.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Where cgroup v1 mounts the cpu controller: its own directory, or joined with cpuacct.
_V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> tuple[int, int] | None:
    """(quota, period) in microseconds, or None when there is no quota or it cannot be read."""
    v2 = root / "cpu.max"
    if v2.is_file():
        return _quota(*_read(v2).split()[:2])
    for name in _V1_CPU_DIRS:
        quota, period = root / name / "cpu.cfs_quota_us", root / name / "cpu.cfs_period_us"
        if quota.is_file() and period.is_file():
            return _quota(_read(quota), _read(period))
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _quota(quota: str = "", period: str = "") -> tuple[int, int] | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max", empty or unreadable
        return None
    if q <= 0 or p <= 0:  # v1's -1: no quota
        return None
    return q, p


def affinity_cpus() -> int:
    """CPUs this process may run on (its affinity mask; all CPUs where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def cpu_budget(root: Path = CGROUP_ROOT, affinity: int | None = None) -> int:
    """Threads worth running: the cgroup CPU quota rounded up, at least 1, at most `affinity`
    (default: this process's affinity mask)."""
    allowed = affinity if affinity is not None else affinity_cpus()
    quota = cgroup_cpu_quota(root)
    if quota is None:
        return max(1, allowed)
    q, p = quota
    return max(1, min(allowed, -(-q // p)))  # the quota in CPUs, rounded up
