"""One gate for the captures of a process: a compiled capture runs alone, every other capture beside the others.

torch.compile's dynamo keeps process-wide state: its caches, its counters and the guards that check which dispatch
modes are active. An eager capture's dispatch mode running in another thread makes a compiled step recompile in the
middle of its step, and dynamo's weak-reference clean-ups fired from other threads' collections have hung a pool
thread beside it. So a compiled capture waits until no capture runs, and holds the others off until it has ended
and dynamo has been reset; the other captures share the gate as before. A compiled capture waiting goes first:
captures that arrive after it wait behind it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_CONDITION = threading.Condition()
_state = {"sharing": 0, "alone": False, "waiting_alone": 0}
_held = threading.local()  # depth of this thread's shared() calls


@contextlib.contextmanager
def shared() -> Iterator[None]:
    """Held by every capture that is not compiled: any number at once, none while a compiled one runs or waits.
    A thread that holds it already (a simulation capturing its single-device figures) goes on without waiting."""
    if getattr(_held, "depth", 0):
        _held.depth += 1
        try:
            yield
        finally:
            _held.depth -= 1
        return
    with _CONDITION:
        _CONDITION.wait_for(lambda: not _state["alone"] and not _state["waiting_alone"])
        _state["sharing"] += 1
    _held.depth = 1
    try:
        yield
    finally:
        _held.depth = 0
        with _CONDITION:
            _state["sharing"] -= 1
            _CONDITION.notify_all()


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Held by a compiled capture: it starts when no other capture runs, and none starts until it ends."""
    with _CONDITION:
        _state["waiting_alone"] += 1
        try:
            _CONDITION.wait_for(lambda: not _state["alone"] and not _state["sharing"])
        finally:
            _state["waiting_alone"] -= 1
        _state["alone"] = True
    try:
        yield
    finally:
        with _CONDITION:
            _state["alone"] = False
            _CONDITION.notify_all()
