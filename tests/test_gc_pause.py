"""The cyclic collector's pause is shared by captures running side by side in threads: it stays off until the
last one ends, and comes back as it was before the first."""

import gc
import threading

from graphviz_core.capture.gc_pause import no_cyclic_gc


def test_the_pause_lasts_from_the_first_capture_in_to_the_last_one_out():
    assert gc.isenabled()
    a_in, b_in, a_out, b_may_leave = (threading.Event() for _ in range(4))
    seen = {}

    def a():
        with no_cyclic_gc():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with no_cyclic_gc(collect_first=True):
            b_in.set()
            a_out.wait(10)
            seen["after A left, B still inside"] = gc.isenabled()  # A ends first: B's capture is still paused
            b_may_leave.wait(10)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    a_out.wait(10)
    b_may_leave.set()
    for t in threads:
        t.join(10)
    assert seen == {"after A left, B still inside": False}
    assert gc.isenabled()  # back on after the last one out


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with no_cyclic_gc():
            with no_cyclic_gc():
                assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
