"""The process's capture gate: a compiled capture runs alone, the others side by side (graphviz_core.capture.step_gate)."""

from __future__ import annotations

import threading
import time

from graphviz_core.capture import step_gate


def test_captures_share_the_gate_and_a_compiled_one_waits_for_them_then_runs_alone():
    events: list[str] = []
    inside = threading.Event()
    release = threading.Event()

    def sharing(name: str) -> None:
        with step_gate.shared():
            events.append(f"{name} in")
            inside.set()
            release.wait(5)
            events.append(f"{name} out")

    def compiled() -> None:
        with step_gate.alone():
            events.append("compiled in")
            events.append("compiled out")

    first = threading.Thread(target=sharing, args=("eager",))
    first.start()
    assert inside.wait(5)
    alone = threading.Thread(target=compiled)
    alone.start()
    time.sleep(0.2)  # the compiled capture is waiting for the eager one to end
    late = threading.Thread(target=sharing, args=("late",))  # arrives after the compiled one: waits behind it
    late.start()
    time.sleep(0.2)
    assert events == ["eager in"]
    release.set()
    for thread in (first, alone, late):
        thread.join(5)
    assert events == ["eager in", "eager out", "compiled in", "compiled out", "late in", "late out"]


def test_a_thread_holding_the_gate_takes_it_again_without_waiting_for_a_compiled_capture_queued_behind_it():
    queued = threading.Event()
    done = []

    def compiled() -> None:
        queued.set()
        with step_gate.alone():
            done.append("compiled")

    with step_gate.shared():
        waiter = threading.Thread(target=compiled)
        waiter.start()
        assert queued.wait(5)
        time.sleep(0.1)
        with step_gate.shared():  # a simulation capturing its single-device figures: no deadlock
            done.append("nested")
    waiter.join(5)
    assert done == ["nested", "compiled"]
