"""Reading Linux /proc for the tools: a process's or thread's stat fields, CPU ticks and
involuntary context switches."""

from __future__ import annotations

import os


def stat_fields(path: str) -> list[str] | None:
    """The fields of a `/proc/<pid>/stat` or `/proc/<pid>/task/<tid>/stat` file after the
    command name, which may hold spaces and parentheses: `fields[0]` is the state,
    `fields[3]` the session id, `fields[11]` and `fields[12]` the user and system CPU
    ticks. None when the process or thread is gone."""
    try:
        with open(path) as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_ticks(fields: list[str]) -> int:
    """User plus system CPU time, in clock ticks (os.sysconf("SC_CLK_TCK") a second)."""
    return int(fields[11]) + int(fields[12])


def process_ids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def thread_ids(pid: int) -> list[int]:
    """The threads of `pid` (its main thread's id is `pid`); empty when it is gone."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def read_text(path: str) -> str:
    """A small /proc file (`cmdline`, `comm`) with its NULs as spaces; "" when it is gone."""
    try:
        with open(path, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def involuntary_switches(task_dir: str) -> int:
    """How often the scheduler took the CPU away from this thread (or process) while it
    could still run: `nonvoluntary_ctxt_switches` in its status file; 0 when it is gone."""
    try:
        with open(os.path.join(task_dir, "status")) as status:
            for line in status:
                if line.startswith("nonvoluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
