"""workers.serving.host_memory: a CPU worker reuses freed large blocks instead of page-faulting anew."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
TENSOR_BYTES = 16 * 1024**2  # larger than glibc's default mmap threshold (128 KiB, dynamic up to 32 MiB)


def minor_faults_while(repeats: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        torch.empty(TENSOR_BYTES // 4, dtype=torch.float32).fill_(1.0)  # touch every page, then free
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_large_tensors_are_reused_without_new_page_faults():
    # In a fresh interpreter: in the suite's process, Ray's and Serve's threads (the session's
    # driver, handles' routers) allocate beside the test and can take the freed block.
    script = """
import resource, torch
from tests.unit.serving.test_host_memory import minor_faults_while, TENSOR_BYTES
from workers.serving.host_memory import keep_freed_memory
assert keep_freed_memory()
minor_faults_while(2)  # the first allocation may grow the heap
print(minor_faults_while(20), TENSOR_BYTES // resource.getpagesize())
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    faults, pages_per_tensor = map(int, done.stdout.split())
    # Each of 20 allocations would fault in all its pages if the block went back to the kernel.
    assert faults < pages_per_tensor
