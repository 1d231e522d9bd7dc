"""`make test`: the suite as two lanes of pytest processes at once, so that both cores work.

- Lane 1: the tests that start Ray clusters, servers and subprocesses (mostly waiting on them).
- Lane 2: the in-process tests (one torch thread each: tests/conftest.py), then, once they
  end, a second Ray part: a few Ray files with a cluster of their own, which lane 1 would
  otherwise run alone while a core idles (on a 2-core Xeon the Ray part alone kept the
  machine 60-70 % busy).

Each part's output is printed whole when it ends, and the exit status fails if any part fails.

    python -m tools.run_tests [extra pytest arguments, given to every part]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What starts Ray clusters, servers or other processes (folders, or single files where the
# rest of a folder is in-process); everything else under tests/ is in-process. Reliability
# first: its loads and kills then run beside the in-process tests, not beside a second cluster.
PROCESS_TESTS = ("tests/reliability", "tests/serve", "tests/clients", "tests/e2e/test_default_model_e2e.py",
                 "tests/tools/test_bench_compare.py", "tests/tools/test_bench_gpu_service.py",
                 "tests/tools/test_servers.py", "tests/tools/test_cpu_share.py")
# The Ray files lane 2 runs after the in-process part: ~130 s of the Ray part's ~510 s alone
# (measured on a 2-core Xeon: both parts 552 s as two processes, 497 s with these, 537 s
# with only the first three; the machine then stays 90-100 % busy, so more lanes gain nothing).
# Two clusters at once are safe: the fault tests kill through their own cluster (ray.kill),
# and the one file that kills by process title (ray::ShardActor) is the only one that starts
# such processes (a test checks); these files wait with timeouts, they bound no latency.
LATE_PROCESS_TESTS = ("tests/serve/test_tensor_parallel_serve.py", "tests/serve/test_disaggregation_serve.py",
                      "tests/serve/test_http_edge.py", "tests/serve/test_multi_model.py",
                      "tests/serve/test_vision_serve.py")
# Each lane runs its parts one after the other.
LANES = (("processes",), ("in-process", "late processes"))


def parts() -> dict[str, list[str]]:
    """Each part's pytest paths: folders, or a folder's files where some of it runs elsewhere."""
    in_process = []
    for folder in sorted((ROOT / "tests").iterdir()):
        name = f"tests/{folder.name}"
        if not folder.is_dir() or folder.name == "support" or folder.name.startswith(("_", ".")) \
                or name in PROCESS_TESTS:
            continue
        in_process += _without(name, PROCESS_TESTS)
    processes = [path for name in PROCESS_TESTS for path in _without(name, LATE_PROCESS_TESTS)]
    return {"processes": processes, "in-process": in_process, "late processes": list(LATE_PROCESS_TESTS)}


def _without(folder: str, elsewhere: tuple[str, ...]) -> list[str]:
    """`folder` whole, or its test files but those in `elsewhere` when some of them are."""
    if not any(path.startswith(folder + "/") for path in elsewhere):
        return [folder]
    files = sorted(f"{folder}/{f.name}" for f in (ROOT / folder).glob("test_*.py"))
    return [path for path in files if path not in elsewhere]


def run_lane(names: tuple[str, ...], split: dict[str, list[str]], argv: list[str], scratch: Path,
             codes: dict[str, int], printing: threading.Lock) -> None:
    for name in names:
        with open(scratch / f"{name}.log", "w+") as log:
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *split[name], *argv]
            codes[name] = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
            log.seek(0)
            with printing:
                print(f"===== {name} ({' '.join(split[name])}): exit {codes[name]}", flush=True)
                sys.stdout.write(log.read())
                sys.stdout.flush()


def main(argv: list[str]) -> int:
    started = time.monotonic()
    split, codes, printing = parts(), {}, threading.Lock()
    with tempfile.TemporaryDirectory() as scratch:
        lanes = [threading.Thread(target=run_lane, args=(names, split, argv, Path(scratch), codes, printing))
                 for names in LANES]
        for lane in lanes:
            lane.start()
        for lane in lanes:
            lane.join()
    failed = [name for names in LANES for name in names if codes.get(name, 1)]
    print(f"===== all parts in {time.monotonic() - started:.0f} s; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
