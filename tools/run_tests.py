"""`make test`: the suite as three pytest processes at once: two for the tests that start Ray
clusters, servers and subprocesses (mostly waiting on them: tests/serve in one, the rest in
the other, each with a Ray cluster of its own) and one for the in-process tests (one torch
thread each: tests/conftest.py), so that both cores work; each one's output is printed
whole when it ends, and the exit status fails if any part fails.

    python -m tools.run_tests [extra pytest arguments, given to both parts]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What starts Ray clusters, servers or other processes (folders, or single files where the
# rest of a folder is in-process); everything else under tests/ is in-process.
PROCESS_TESTS = ("tests/serve", "tests/reliability", "tests/clients", "tests/e2e/test_default_model_e2e.py",
                 "tests/tools/test_bench_compare.py", "tests/tools/test_bench_gpu_service.py",
                 "tests/tools/test_servers.py", "tests/tools/test_cpu_share.py")
# Of those, what runs as a pytest process of its own. Two clusters at once must not touch
# each other's processes: kills go through the cluster's own actors (ray.kill), and the one
# test that finds processes by title (ray::ShardActor, test_tensor_parallel_serve.py) is the
# only one to start such processes.
OWN_PROCESS = ("tests/serve",)


def parts() -> dict[str, list[str]]:
    in_process = []
    for folder in sorted((ROOT / "tests").iterdir()):
        name = f"tests/{folder.name}"
        if not folder.is_dir() or folder.name == "support" or folder.name.startswith(("_", ".")) \
                or name in PROCESS_TESTS:
            continue
        if any(path.startswith(name + "/") for path in PROCESS_TESTS):  # split: its other test files
            in_process += sorted(f"{name}/{f.name}" for f in folder.glob("test_*.py")
                                 if f"{name}/{f.name}" not in PROCESS_TESTS)
        else:
            in_process.append(name)
    rest = [path for path in PROCESS_TESTS if path not in OWN_PROCESS]
    return {**{path.removeprefix("tests/"): [path] for path in OWN_PROCESS}, "processes": rest,
            "in-process": in_process}


def main(argv: list[str]) -> int:
    started = time.monotonic()
    running = {}
    split = parts()
    with tempfile.TemporaryDirectory() as scratch:
        for name, paths in split.items():
            log = open(Path(scratch) / f"{name}.log", "w+")
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths, *argv]
            running[name] = (subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log)
        failed = []
        for name, (process, log) in running.items():
            code = process.wait()
            log.seek(0)
            print(f"===== {name} ({' '.join(split[name])}): exit {code}", flush=True)
            sys.stdout.write(log.read())
            log.close()
            if code:
                failed.append(name)
    print(f"===== all parts in {time.monotonic() - started:.0f} s; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
