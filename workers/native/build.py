"""Builds one of the worker's C sources into a shared library with the host's C compiler,
once per machine, and loads it through ctypes (which releases the GIL for each call).

A build takes about a second, so it is done at the first use rather than at install time:
`-march=native` makes it the best code for the CPU it runs on, and the cache key holds
the source with every file it includes, the compiler and the CPU's flags, so a cache
directory shared by machines of different kinds keeps one build for each. torch is imported first so the library's
OpenMP calls land in torch's own runtime (one thread pool for both).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loaded first: libgomp.so.1 is then torch's, shared by the library)

from workers.contract.model_config import default_cache_dir

logger = logging.getLogger(__name__)

COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def compiler() -> str | None:
    """The C compiler to build with: $CC, else gcc or cc on PATH."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def load_library(source: Path, what: str) -> ctypes.CDLL | None:
    """`source` built (or found built) for this machine and loaded; None without a C
    compiler or when the build fails (logged as `what` not being available)."""
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler (gcc/cc) on PATH: %s", what)
        return None
    try:
        return ctypes.CDLL(str(built_library(cc, source)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("building %s failed (%s): %s", source.name, exc, what)
        return None


def built_library(cc: str, source: Path) -> Path:
    target = default_cache_dir() / "kernels" / f"{source.stem}-{_build_key(cc, source)}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([cc, *COMPILE_FLAGS, "-o", str(built), str(source)], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(built, target)  # atomic: replicas building at once each land a whole file
    logger.info("built %s: %s", source.name, target)
    return target


def _build_key(cc: str, source: Path) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for included in local_sources(source):  # the source and what it includes (vector_math.h, other sources)
        digest.update(included.read_bytes())
    for part in (version, " ".join(COMPILE_FLAGS), _cpu_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def local_sources(source: Path) -> list[Path]:
    """`source` and every file it includes by a quoted relative path, recursively, once each."""
    found, pending = [], [source.resolve()]
    while pending:
        path = pending.pop()
        if path in found:
            continue
        found.append(path)
        for name in LOCAL_INCLUDE.findall(path.read_text()):
            pending.append((path.parent / name).resolve())
    return found


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""
