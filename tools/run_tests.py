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
# The parts that run Ray or other processes; everything else under tests/ is in-process.
PROCESS_TESTS = ("tests/serve", "tests/reliability", "tests/clients", "tests/e2e", "tests/tools")


def parts() -> dict[str, list[str]]:
    tests = ROOT / "tests"
    in_process = sorted(f"tests/{p.name}" for p in tests.iterdir()
                        if p.is_dir() and f"tests/{p.name}" not in PROCESS_TESTS and p.name != "support"
                        and not p.name.startswith(("_", ".")))
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
