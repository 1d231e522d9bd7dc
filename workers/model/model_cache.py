"""Model copies converted once into the model cache (a GGUF file as a transformers
directory, a quantized checkpoint dequantized): one conversion per target however many
replicas on a machine start at once, never a half-written copy taken for a whole one, and
one copy a source: a changed source (a reinstalled package's GGUF, a new checkpoint) takes
its older copies' place instead of piling up beside them (~0.5 GB each for the default
model). Each copy names the path it came from, so the same file name in two places (two
virtual environments' packages) keeps a copy each."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE_FILE = ".chatserve-source"  # in each copy: the source's resolved path


def source_identity(stats: list[os.stat_result]) -> str:
    """A source's version in a copy's name: its files' total size and newest mtime."""
    return f"{sum(s.st_size for s in stats)}-{int(max(s.st_mtime for s in stats))}"


def converted_once(cache_dir: Path, name: str, identity: str, source: Path, convert: Callable[[Path], None],
                   what: str) -> Path:
    """`cache_dir`/`name`-`identity`, made by `convert(directory)` on the first call only.
    Under a file lock (a second replica waits for the first one's conversion), into the
    target's .tmp (cleared when an interrupted conversion left it) and renamed: a copy with
    its config.json is whole. Then the copies of `source`'s other identities are removed."""
    target = cache_dir / f"{name}-{identity}"
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(str(target) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            logger.info("converting %s into %s (first start only)", what, target)
            tmp = target.with_name(target.name + ".tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            convert(tmp)
            (tmp / SOURCE_FILE).write_text(str(source.resolve()))
            tmp.rename(target)
    for stale in older_copies(cache_dir, name, identity, source):
        remove_unless_busy(stale)
    return target


def older_copies(cache_dir: Path, name: str, identity: str, source: Path) -> list[Path]:
    """`source`'s copies in `cache_dir` (named `name`) whose identity is not `identity`,
    whole or half-written; a copy that names no source (half-written, or from before
    copies named theirs) counts as `source`'s, and so does one whose source is gone (a
    deleted virtual environment's package)."""
    pattern, resolved = re.compile(re.escape(name) + r"-(\d+-\d+)(\.tmp)?"), str(source.resolve())
    return [entry for entry in cache_dir.iterdir()
            if entry.is_dir() and (match := pattern.fullmatch(entry.name)) and match.group(1) != identity
            and ((origin := copied_from(entry)) in (None, resolved) or not Path(origin).exists())]


def copied_from(copy: Path) -> str | None:
    try:
        return (copy / SOURCE_FILE).read_text()
    except OSError:
        return None


def remove_unless_busy(copy: Path) -> None:
    """Remove `copy` (and its lock file) unless another process holds its lock: a replica
    still converting that version. A process that loaded it keeps its open files."""
    whole = copy.with_name(copy.name.removesuffix(".tmp"))
    lock_path = Path(str(whole) + ".lock")
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        logger.info("removing %s: a copy of an older version of its source, or of a source that is gone", copy)
        shutil.rmtree(copy, ignore_errors=True)
        if not whole.exists() and not whole.with_name(whole.name + ".tmp").exists():
            lock_path.unlink(missing_ok=True)
