"""`make test`'s split (tools/run_tests.py): every test file runs in exactly one of its pytest
parts, the files that start Ray or servers are never in the in-process one, and the two Ray
parts (which run at once) cannot kill each other's processes."""

from __future__ import annotations

from pathlib import Path

from tools.run_tests import LANES, LATE_PROCESS_TESTS, PROCESS_TESTS, ROOT, parts


def _files(paths: list[str]) -> list[Path]:
    found = []
    for path in paths:
        target = ROOT / path
        found += [target] if target.is_file() else sorted(target.rglob("test_*.py"))
    return found


def test_every_test_file_is_in_exactly_one_part():
    split = parts()
    every = sorted(p for p in (ROOT / "tests").rglob("test_*.py")
                   if "node_modules" not in p.parts and "support" not in p.relative_to(ROOT / "tests").parts)
    assert sorted(name for lane in LANES for name in lane) == sorted(split)  # every part runs, once
    listed = [path for paths in split.values() for path in _files(paths)]
    listed = [p for p in listed if "node_modules" not in p.parts]
    assert sorted(listed) == every  # none twice, none left out


def test_what_starts_ray_stays_in_the_process_part():
    """The Serve fixtures (serve_instance and the apps built on it) and ray.init start a
    cluster; the fault tests find replicas by process title, so two processes running
    clusters at once could kill each other's."""
    markers = ("serve_instance", "tiny_app", "tools_app", "ray.init(")
    for path in _files(parts()["in-process"]):
        if path.resolve() == Path(__file__).resolve():
            continue  # names the markers
        text = path.read_text()
        assert not any(marker in text for marker in markers), path
    assert all((ROOT / path).exists() for path in PROCESS_TESTS + LATE_PROCESS_TESTS)
    assert all(any(path.startswith(folder) for folder in PROCESS_TESTS) for path in LATE_PROCESS_TESTS)


def test_the_files_that_kill_shards_by_process_title_run_in_one_part():
    """test_tensor_parallel_serve.py SIGKILLs every ray::ShardActor process of the machine: the
    files that start shards (a tensor- or pipeline-parallel model) must all be in its part, or
    it would kill the other Ray part's."""
    split = parts()
    starters = {name for name in ("processes", "late processes") for path in _files(split[name])
                if _starts_shards(path.read_text())}
    assert len(starters) == 1, starters


def _starts_shards(text: str) -> bool:
    return "tensor_parallel_size" in text or "pipeline_parallel_size" in text
