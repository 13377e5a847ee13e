"""The web server as `make run` starts it (graphviz_core.ui.serve), each capture's phases observed: one JSON line per
capture on stderr with every thread's CPU time over it, the machine's busy time over it, and its TimeSummary.
Run by tests/test_timing_notice.py to see what shares the interpreter and the cores with a capture."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from graphviz_core.capture import engine

TICK = os.sysconf("SC_CLK_TCK")
MARK = "CAPTURE-THREADS "


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process, by native id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / TICK


_capture = engine._Phases.capture


def observed_capture(self):
    before, busy, started = thread_cpu_s(), machine_busy_s(), time.perf_counter()
    result = _capture(self)
    after, busy, wall = thread_cpu_s(), machine_busy_s() - busy, time.perf_counter() - started
    names = {t.native_id: t.name for t in threading.enumerate()}
    me = threading.get_native_id()
    threads = {names.get(tid, str(tid)): round(cpu - before.get(tid, 0.0), 4) for tid, cpu in after.items() if tid != me}
    t = result.time
    sys.stderr.write(MARK + json.dumps({"config": self.run.config.describe(), "wall_s": wall, "machine_busy_s": busy,
                                        "process_s": sum(after.values()) - sum(before.values()), "threads": threads,
                                        "cpu_share": t.cpu_share, "disturbed": t.disturbed}) + "\n")
    sys.stderr.flush()
    return result


if __name__ == "__main__":
    from graphviz_core.ui import serve

    # only in the server this module starts: a test that imports MARK from here (test_timing_notice) once left every
    # later capture in its pytest worker writing this line to stderr, under whichever test ran next
    engine._Phases.capture = observed_capture

    serve.main()
