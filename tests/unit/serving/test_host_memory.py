"""workers.serving.host_memory: a CPU worker reuses freed large blocks instead of page-faulting anew."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from workers.serving.host_memory import keep_freed_memory

TENSOR_BYTES = 16 * 1024**2  # larger than glibc's default mmap threshold (128 KiB, dynamic up to 32 MiB)


def minor_faults_while(repeats: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        torch.empty(TENSOR_BYTES // 4, dtype=torch.float32).fill_(1.0)  # touch every page, then free
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_large_tensors_are_reused_without_new_page_faults():
    assert keep_freed_memory()
    minor_faults_while(2)  # the first allocation may grow the heap
    pages_per_tensor = TENSOR_BYTES // resource.getpagesize()
    # Each of 20 allocations would fault in all its pages if the block went back to the kernel.
    assert minor_faults_while(20) < pages_per_tensor
