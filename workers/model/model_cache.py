"""Model copies converted once into the model cache (a GGUF file as a transformers
directory, a quantized checkpoint dequantized): one conversion per target however many
replicas on a machine start at once, and never a half-written copy taken for a whole one."""

from __future__ import annotations

import fcntl
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def converted_once(target: Path, convert: Callable[[Path], None], what: str) -> Path:
    """`target`, made by `convert(directory)` on the first call only. Under a file lock (a
    second replica waits for the first one's conversion), into `target`.tmp (cleared when an
    interrupted conversion left it) and renamed: a copy with its config.json is whole."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(str(target) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            logger.info("converting %s into %s (first start only)", what, target)
            tmp = target.with_name(target.name + ".tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            convert(tmp)
            tmp.rename(target)
    return target
