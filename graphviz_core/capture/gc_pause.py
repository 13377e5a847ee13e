"""Python's cyclic garbage collector paused while a capture (or a simulated parallel step) runs."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_pausing = 0  # captures (in any thread) inside no_cyclic_gc now
_was_enabled = True  # the collector's state when the first of them came in


@contextlib.contextmanager
def no_cyclic_gc(collect_first: bool = False) -> Iterator[None]:
    """Python's cyclic collector paused while a capture (or a simulated parallel step) runs; `collect_first`
    clears the garbage recent work left (the two young generations: what the last simulated step made) before the
    pause.

    A capture allocates thousands of small objects (node records, hook closures, the networkx graph); each
    few hundred start a collection that walks every tracked object in the process (400,000 once torch and
    transformers are imported), and cProfile charged 0.44 s of a 1.09 s meta capture of 8 Llama-70B layers to
    networkx's add_node, which only allocates. Nothing a capture makes needs the cyclic collector to be freed
    (tests/test_capture.py checks the model goes by reference counting), so it resumes afterwards as it was.

    `collect_first` collects the young generations only. A full collection walks every object the process holds:
    0.1-0.44 s each in a test process, and the 4 planner, pipeline, parallel-matrix and LoRA test files spent 42 s of
    their 131 s in the 136 full collections their simulations asked for (0.2 s in young ones). What a full one would
    find besides is older garbage, which no tracker of the next step sees: the trackers are made for that step and
    follow only the tensors it creates.

    The collector is one per process: captures running side by side in threads share one pause, from the first
    one in to the last one out, and the state before the first is the state after the last.
    """
    global _pausing, _was_enabled
    if collect_first:
        gc.collect(1)
    with _lock:
        if not _pausing:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pausing += 1
    try:
        yield
    finally:
        with _lock:
            _pausing -= 1
            if not _pausing and _was_enabled:
                gc.enable()
