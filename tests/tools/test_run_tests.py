"""`make test`'s split (tools/run_tests.py): every test file runs in exactly one of the
pytest processes, and the files that start Ray or servers are never in the in-process one."""

from __future__ import annotations

from pathlib import Path

from tools.run_tests import OWN_PROCESS, PROCESS_TESTS, ROOT, parts


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
    listed = [path for paths in split.values() for path in _files(paths)]
    listed = [p for p in listed if "node_modules" not in p.parts]
    assert sorted(listed) == every  # none twice, none left out


def test_what_starts_ray_stays_in_the_process_part():
    """The Serve fixtures (serve_instance and the apps built on it) and ray.init start a
    cluster: never in the in-process part, whose tests time themselves."""
    markers = ("serve_instance", "tiny_app", "tools_app", "ray.init(")
    for path in _files(parts()["in-process"]):
        if path.resolve() == Path(__file__).resolve():
            continue  # names the markers
        text = path.read_text()
        assert not any(marker in text for marker in markers), path
    assert all((ROOT / path).exists() for path in PROCESS_TESTS)


def test_only_one_part_finds_processes_by_title():
    """The Ray parts run at once, each with a cluster of its own: a test that kills processes
    found by title, not through its own cluster's actors, must be the only one to start
    processes of that title (ray::ShardActor: tensor-parallel workers)."""
    split = parts()
    ray_files = [path for name, paths in split.items() if name != "in-process" for path in _files(paths)]
    by_title = [path.relative_to(ROOT).as_posix() for path in ray_files
                if "process_ids()" in path.read_text() and "os.kill" in path.read_text()]
    assert by_title == ["tests/serve/test_tensor_parallel_serve.py"]
    sharded = [path.relative_to(ROOT).as_posix() for path in ray_files if "tensor_parallel_size" in path.read_text()]
    assert sharded == by_title
    assert set(OWN_PROCESS) <= set(PROCESS_TESTS)
