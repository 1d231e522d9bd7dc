"""The model cache keeps one converted copy a source: a changed source's conversion takes
the older copies' place; a copy being converted elsewhere stays, and so do other sources'
copies, those of a file of the same name elsewhere included."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from workers.model.model_cache import converted_once, source_identity


def writer(calls: list[Path]):
    def convert(directory: Path) -> None:
        calls.append(directory)
        directory.mkdir()
        (directory / "config.json").write_text("{}")
    return convert


def copies(cache: Path) -> list[str]:
    return sorted(entry.name for entry in cache.iterdir())


def test_a_changed_source_replaces_its_older_copy_and_leaves_other_sources(tmp_path):
    cache, calls, source = tmp_path / "cache", [], tmp_path / "model.gguf"
    first = converted_once(cache, "model", "100-1", source, writer(calls), "v1")
    other = converted_once(cache, "other-model", "100-1", tmp_path / "other-model.gguf", writer(calls), "another")
    prefixed = converted_once(cache, "model-awq", "100-1", tmp_path / "model", writer(calls), "named model-...")
    assert converted_once(cache, "model", "100-1", source, writer(calls), "v1") == first and len(calls) == 3
    (cache / "model-100-0.tmp").mkdir()  # an interrupted conversion of an older version
    second = converted_once(cache, "model", "101-2", source, writer(calls), "v2")
    assert len(calls) == 4 and (second / "config.json").is_file()
    assert not first.exists() and not Path(f"{first}.lock").exists() and not (cache / "model-100-0.tmp").exists()
    assert other.is_dir() and prefixed.is_dir()
    assert copies(cache) == sorted([second.name, f"{second.name}.lock", other.name, f"{other.name}.lock",
                                    prefixed.name, f"{prefixed.name}.lock"])


def test_a_file_of_the_same_name_elsewhere_keeps_its_own_copy_while_it_exists(tmp_path):
    cache, calls = tmp_path / "cache", []
    a, b = tmp_path / "venv-a" / "model.gguf", tmp_path / "venv-b" / "model.gguf"
    for source in (a, b):
        source.parent.mkdir()
        source.write_bytes(b"gguf")
    here = converted_once(cache, "model", "100-1", a, writer(calls), "a")
    there = converted_once(cache, "model", "100-2", b, writer(calls), "b")
    assert here.is_dir() and there.is_dir()
    assert converted_once(cache, "model", "100-1", a, writer(calls), "a") == here
    assert len(calls) == 2 and there.is_dir()
    b.unlink()  # venv-b deleted: its copy goes at the next conversion or load of the name
    converted_once(cache, "model", "100-1", a, writer(calls), "a")
    assert here.is_dir() and not there.exists()


def test_a_copy_whose_lock_another_process_holds_stays(tmp_path):
    cache = tmp_path / "cache"
    source = tmp_path / "model.gguf"
    busy = converted_once(cache, "model", "100-1", source, writer([]), "v1")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"lock = open({str(busy) + '.lock'!r}, 'a')\n"
        "fcntl.flock(lock, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        newer = converted_once(cache, "model", "101-2", source, writer([]), "v2")
        assert busy.is_dir() and newer.is_dir()
    finally:
        holder.kill()
        holder.wait()
    converted_once(cache, "model", "101-2", source, writer([]), "v2")  # the holder is gone: now it goes
    assert not busy.exists()


def test_the_identity_is_the_files_total_size_and_newest_mtime(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 10)
    b.write_bytes(b"y" * 5)
    os.utime(a, (time.time(), 1000.7))
    os.utime(b, (time.time(), 2000.2))
    assert source_identity([a.stat(), b.stat()]) == "15-2000"
