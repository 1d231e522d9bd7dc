"""`make test`: the suite as two pytest processes at once, one for the tests that start Ray
clusters, servers and subprocesses (mostly waiting on them) and one for the in-process tests
(one torch thread each: tests/conftest.py), so that both cores work; each one's output is
printed whole when it ends, and the exit status fails if either part fails.

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
    return {"processes": list(PROCESS_TESTS), "in-process": in_process}


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
    print(f"===== both parts in {time.monotonic() - started:.0f} s; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
