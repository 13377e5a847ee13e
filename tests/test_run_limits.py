"""The server's run time limit: a capture it stops frees everything it held, and dry runs (`meta`) get the same
limit, cancel and queue as real captures, in this process and in the worker processes."""

from __future__ import annotations

import gc
import time

from graphviz_core.capture.admission import (
    RUN_TIMEOUT_ENV,
    CaptureCancelled,
    return_freed_memory,
    rss_bytes,
)
from graphviz_core.capture.device import estimate_peak_bytes
from graphviz_core.capture.engine import capture_backward
from graphviz_core.capture.workers import capture_anywhere
from graphviz_core.config import config_from_preset
from graphviz_core.serve.shared_captures import SharedCaptures

# Eight gpt2-tiny layers at batch 16 x seq 512: the forward keeps ~300 MiB for backward (estimate_peak_bytes: 324 MiB)
# and still builds and runs its forward in a second or two here.
HEAVY = config_from_preset("gpt2-tiny", device="cpu", layers=8, batch=16, seq=512).replace(preset="")


def _past_the_limit_at_backward(config, progress=None, ticket=None):
    """The shared store's own capture, with its progress line slowed at the backward's start by more than the run
    time limit, so the limit stops it at the first autograd node, the whole forward graph alive: the most a stopped
    capture can hold."""

    def slow(phase):
        if progress is not None:
            progress(phase)
        if phase == "running the backward pass":
            time.sleep(1.0)

    return capture_anywhere(config, slow, ticket)


def test_captures_stopped_by_the_run_time_limit_give_back_what_they_held(monkeypatch):
    assert estimate_peak_bytes(HEAVY) > 300 * 2**20
    capture_backward(HEAVY.replace(batch=1, seq=8))  # this kind's one-time costs, paid before measuring
    monkeypatch.setenv(RUN_TIMEOUT_ENV, "0.5")
    store = SharedCaptures(capture=_past_the_limit_at_backward)
    gc.collect()
    start = return_freed_memory().rss_after_bytes
    for seed in (1, 2, 3):
        job = store.request(HEAVY.replace(seed=seed), f"session-{seed}")
        assert job.done.wait(300)
        assert isinstance(job.error, CaptureCancelled), job.error
        assert "run time limit of 0.5 s" in str(job.error)
        assert job.error.__traceback__ is None  # the stored error keeps no frames (and through them no tensors)
        del job
    gc.collect()
    return_freed_memory()
    after = rss_bytes()
    # Each stopped capture held ~300 MiB: three kept would be ~900 MiB more; 10% of the start is the allowance for
    # the allocator's own bookkeeping.
    assert after <= 1.10 * start, f"RSS {start / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after"
