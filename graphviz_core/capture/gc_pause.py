"""Python's cyclic garbage collector paused while a capture (or a simulated parallel step) runs."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def no_cyclic_gc(collect_first: bool = False) -> Iterator[None]:
    """Python's cyclic collector paused while a capture (or a simulated parallel step) runs; `collect_first`
    clears what is already garbage before the pause.

    A capture allocates thousands of small objects (node records, hook closures, the networkx graph); each
    few hundred start a collection that walks every tracked object in the process (400,000 once torch and
    transformers are imported), and cProfile charged 0.44 s of a 1.09 s meta capture of 8 Llama-70B layers to
    networkx's add_node, which only allocates. Nothing a capture makes needs the cyclic collector to be freed
    (tests/test_capture.py checks the model goes by reference counting), so it resumes afterwards as it was.
    """
    was_enabled = gc.isenabled()
    if collect_first:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
