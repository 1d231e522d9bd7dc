"""tools/bench/cpu_share.py: the window arithmetic, and real processes and threads told apart
by the CPU they use."""

from __future__ import annotations

import subprocess
import sys
import time

from tools.bench.cpu_share import (
    TICKS_PER_S,
    Usage,
    process_snapshot,
    report_lines,
    thread_snapshot,
    window,
)

BUSY_3S = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end:\n    pass\n"
BUSY_THREAD_3S = ("import threading, time\n"
                  "def spin():\n"
                  "    end = time.monotonic() + 3\n"
                  "    while time.monotonic() < end:\n"
                  "        pass\n"
                  "threading.Thread(target=spin).start()\n"
                  "time.sleep(3)\n")


def test_window_keeps_the_growth_of_what_lived_through_it():
    before = {1: Usage(1, "a", 10, 5), 2: Usage(2, "idle", 10, 0), 3: Usage(3, "ended", 4, 0),
              5: Usage(5, "b", 0, 0)}
    after = {1: Usage(1, "a", 30, 9), 2: Usage(2, "idle", 10, 0), 4: Usage(4, "started", 50, 0),
             5: Usage(5, "b", 70, 1)}
    assert window(before, after) == [Usage(5, "b", 70, 1), Usage(1, "a", 20, 4)]


def test_report_lines_give_shares_of_the_whole_machine():
    used = [Usage(7, "model", 3 * TICKS_PER_S, 40), Usage(8, "ray", TICKS_PER_S // 2, 0)]
    lines = report_lines(used, seconds=2.0, cpus=2, top=1)
    assert len(lines) == 2  # the total, then the top one
    assert lines[0].split()[0] == "87.5"  # 3.5 CPU-seconds of 4
    assert lines[1].split()[0] == "75.0" and "20 preempted/s" in lines[1] and lines[1].endswith("model")


def _run_beside(script: str):
    return subprocess.Popen([sys.executable, "-c", script])


def test_a_busy_process_outranks_a_sleeping_one():
    busy, idle = _run_beside(BUSY_3S), _run_beside("import time; time.sleep(3)")
    try:
        time.sleep(0.5)  # past the interpreter's start
        before = process_snapshot()
        time.sleep(1.0)
        used = {usage.id: usage for usage in window(before, process_snapshot())}
    finally:
        for child in (busy, idle):
            child.kill()
            child.wait()
    assert used[busy.pid].ticks >= 0.3 * TICKS_PER_S
    assert "while time.monotonic()" in used[busy.pid].name
    assert idle.pid not in used or used[idle.pid].ticks * 10 < used[busy.pid].ticks


def test_threads_of_one_process_are_told_apart():
    child = _run_beside(BUSY_THREAD_3S)
    try:
        time.sleep(0.5)
        before = thread_snapshot(child.pid)
        time.sleep(1.0)
        used = window(before, thread_snapshot(child.pid))
    finally:
        child.kill()
        child.wait()
    assert len(before) >= 2
    busiest = used[0]
    assert busiest.id != child.pid  # the spinning thread, not the sleeping main thread
    assert busiest.ticks >= 0.3 * TICKS_PER_S


def test_a_process_that_is_gone_has_no_threads():
    child = _run_beside("pass")
    child.wait()
    assert thread_snapshot(child.pid) == {}
