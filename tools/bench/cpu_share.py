"""Who takes the CPU while a load runs: each process's share of the machine over a window,
or each thread's within one process with how often it was preempted (Linux /proc).

On a small CPU machine the model's threads share the cores with Ray, the ingress, the
HTTP edge and the load generator; this is the measurement behind docs/BENCHMARKS.md's
"Why the Serve path trails the engine on two cores". Run it beside a load, e.g.
`python -m tools.bench.cpu_share --seconds 10` for the processes, then
`--threads-of <the worker's pid>` for that process's threads.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

from tools.procfs import (
    cpu_ticks,
    involuntary_switches,
    process_ids,
    read_text,
    stat_fields,
    thread_ids,
)

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Usage:
    """A process's or thread's CPU ticks and involuntary context switches: counters since
    it started in a snapshot, the growth over the window in a report."""

    id: int
    name: str
    ticks: int
    preempted: int


def _preemptions_of_all_threads(pid: int) -> int:
    # /proc/<pid>/status counts the main thread's switches only; the model's are elsewhere.
    return sum(involuntary_switches(f"/proc/{pid}/task/{tid}") for tid in thread_ids(pid))


def process_snapshot() -> dict[int, Usage]:
    """Every process's counters now, its threads' summed (kernel threads and zombies
    included, with no name)."""
    snapshot = {}
    for pid in process_ids():
        fields = stat_fields(f"/proc/{pid}/stat")
        if fields is not None:
            snapshot[pid] = Usage(pid, read_text(f"/proc/{pid}/cmdline"), cpu_ticks(fields),
                                  _preemptions_of_all_threads(pid))
    return snapshot


def thread_snapshot(pid: int) -> dict[int, Usage]:
    """The counters of each thread of `pid` now; empty when the process is gone."""
    snapshot = {}
    for tid in thread_ids(pid):
        task_dir = f"/proc/{pid}/task/{tid}"
        fields = stat_fields(f"{task_dir}/stat")
        if fields is not None:
            snapshot[tid] = Usage(tid, read_text(f"{task_dir}/comm"), cpu_ticks(fields), involuntary_switches(task_dir))
    return snapshot


def window(before: dict[int, Usage], after: dict[int, Usage]) -> list[Usage]:
    """What each process or thread alive at both ends used in between, busiest first;
    those that used no CPU are left out. One that started or ended inside the window is
    left out too: its counters have no starting point."""
    used = []
    for key, end in after.items():
        start = before.get(key)
        if start is None or end.ticks <= start.ticks:
            continue
        used.append(Usage(key, end.name or start.name, end.ticks - start.ticks, end.preempted - start.preempted))
    return sorted(used, key=lambda usage: usage.ticks, reverse=True)


def report_lines(used: list[Usage], seconds: float, cpus: int, top: int) -> list[str]:
    """Each line: share of the whole machine (all `cpus`), preemptions a second, id, name;
    the first line is the total of everything listed in `used`."""
    capacity = seconds * TICKS_PER_S * cpus
    total = sum(usage.ticks for usage in used)
    lines = [f"{100 * total / capacity:6.1f} % of {cpus} CPUs over {seconds:.0f} s, in all"]
    for usage in used[:top]:
        lines.append(f"{100 * usage.ticks / capacity:6.1f} %  {usage.preempted / seconds:8.0f} preempted/s  "
                     f"{usage.id:>7}  {usage.name[:90]}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="the window")
    parser.add_argument("--top", type=int, default=20, help="lines shown")
    parser.add_argument("--threads-of", type=int, default=None, metavar="PID",
                        help="the threads of this process instead of every process")
    args = parser.parse_args(argv)
    snapshot = process_snapshot if args.threads_of is None else lambda: thread_snapshot(args.threads_of)
    before = snapshot()
    start = time.monotonic()
    time.sleep(args.seconds)
    after = snapshot()
    seconds = time.monotonic() - start
    for line in report_lines(window(before, after), seconds, os.cpu_count() or 1, args.top):
        print(line)


if __name__ == "__main__":
    main()
