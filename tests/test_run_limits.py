"""The server's run time limit: a capture it stops frees everything it held, and dry runs (`meta`) get the same
limit, cancel and queue as real captures, in this process and in the worker processes."""

from __future__ import annotations

import gc
import os
import threading
import time
import types
from concurrent.futures.process import BrokenProcessPool

import pytest

from graphviz_core.capture import admission as admission_module
from graphviz_core.capture import workers
from graphviz_core.capture.admission import (
    RUN_TIMEOUT_ENV,
    CaptureCancelled,
    Ticket,
    admission,
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


# 256 llama-tiny layers on meta: ~20,000 autograd nodes, all Python (64 layers took 2.9 s here, so ~12 s alone).
HUGE_DRY_RUN = config_from_preset("llama-tiny", device="meta", layers=256).replace(preset="")
POOL_START_S = 120  # the fork server imports torch and every family's modules: ~4 s here, more under load


@pytest.fixture
def pool():
    """A pool whose workers answer now. wait_for_pool alone says True for a pool that has since lost a worker (its
    ready flag stays set until a capture meets the break): the next submit then raises BrokenProcessPool and the dry
    run runs in this process instead, never reaching a worker. Such a pool is dropped and a new one waited for."""
    for _ in range(2):
        if not workers.wait_for_pool(POOL_START_S):
            pytest.fail(f"the meta worker processes did not answer within {POOL_START_S} s")
        executor = workers._POOL.ready()
        try:
            executor.submit(os.getpid).result(timeout=POOL_START_S)
            return
        except BrokenProcessPool:
            workers._POOL.broken(executor)
    pytest.fail("the meta worker processes broke twice in a row")


class Handed(list):
    """The futures of the dry runs handed to worker processes, and when the first was handed (time.monotonic)."""

    at: float | None = None


@pytest.fixture
def worker_futures(monkeypatch):
    """The futures of the dry runs handed to worker processes, as the pool's own submit returns them."""
    seen = Handed()
    submit = getattr(workers._POOL, "submit", None)

    def recording(executor, config):
        future, slot = submit(executor, config)
        seen.append(future)
        seen.at = seen.at or time.monotonic()
        return future, slot

    monkeypatch.setattr(workers._POOL, "submit", recording, raising=False)
    return seen


@pytest.fixture
def limit_counts_from_the_handover(monkeypatch, worker_futures):
    """admission's clock stands still until a worker has the dry run, then runs at the real rate.

    The run time limit counts from admission, and admission checks it once at once; the 1 s test limit only tests
    the stop in a worker if the dry run reaches one within that second. On a loaded machine the thread can be held
    up for longer right there (descheduled, or behind another thread holding the interpreter), and the limit then
    stops the dry run at admission, before any worker has it: a fresh-clone run failed that way, `(future,) =
    worker_futures` unpacking an empty list. With this clock no hold-up before the handover counts; the limit
    is still 1 s of real time counted by admission's own deadline, from the moment the worker has the dry run."""
    real = time.monotonic
    still = real()

    def monotonic() -> float:
        return still if worker_futures.at is None else still + (real() - worker_futures.at)

    monkeypatch.setattr(admission_module, "time", types.SimpleNamespace(monotonic=monotonic))


def test_a_dry_run_in_this_process_stops_at_the_run_time_limit(monkeypatch):
    monkeypatch.setenv(workers.PROCESSES_ENV, "0")  # no worker processes: the dry run runs here
    monkeypatch.setenv(RUN_TIMEOUT_ENV, "1")
    with pytest.raises(CaptureCancelled, match="run time limit of 1 s"):
        capture_anywhere(HUGE_DRY_RUN)
    assert admission().load("meta").running == 0


def test_a_dry_run_in_a_worker_stops_there_at_the_run_time_limit(pool, worker_futures, limit_counts_from_the_handover,
                                                                  monkeypatch):
    monkeypatch.setenv(RUN_TIMEOUT_ENV, "1")
    # a hold-up of 1.5 s between admission and the handover (as on a loaded machine) no longer stops it there
    check = Ticket.check

    def held_up_once(ticket):
        if not getattr(ticket, "held_up", False):
            ticket.held_up = True
            time.sleep(1.5)
        check(ticket)

    monkeypatch.setattr(Ticket, "check", held_up_once)
    with pytest.raises(CaptureCancelled, match="run time limit of 1 s"):
        capture_anywhere(HUGE_DRY_RUN, progress=lambda phase: None)
    # the worker stopped its capture too, rather than finishing it for nobody
    (future,) = worker_futures
    assert isinstance(future.exception(timeout=120), CaptureCancelled)


def test_dry_runs_queue_behind_the_workers_with_positions_and_cancel(pool, worker_futures, monkeypatch):
    monkeypatch.setenv(RUN_TIMEOUT_ENV, "600")
    size = workers.pool_size()
    tickets = [Ticket() for _ in range(size + 1)]
    errors: list = []

    def dry_run(ticket):
        try:
            capture_anywhere(HUGE_DRY_RUN.replace(seed=ticket.id), progress=lambda phase: None, ticket=ticket)
        except CaptureCancelled as exc:
            errors.append(exc)

    threads = [threading.Thread(target=dry_run, args=(t,)) for t in tickets]
    for thread in threads[:size]:
        thread.start()
    _wait_until(lambda: admission().load("meta").running == size)
    threads[size].start()
    # one per worker runs; the next waits: "2 ahead of you" with the default two workers
    _wait_until(lambda: tickets[size].ahead() == size)
    assert admission().load("meta").waiting == 1
    tickets[size].cancel("cancelled by the user")
    threads[size].join(10)
    assert tickets[size].state == "cancelled" and not threads[size].is_alive()
    # each dry run handed to its worker before it is cancelled: admission counts it running once admitted, and on a
    # slow machine (a fresh clone at half its usual speed) one was cancelled while still queued for its worker, so
    # its future read CancelledError (never run) where the test asks that a worker stopped it
    _wait_until(lambda: len(worker_futures) == size and all(f.running() or f.done() for f in worker_futures))
    for ticket in tickets[:size]:
        ticket.cancel("cancelled by the user")
    for thread in threads:
        thread.join(60)
    assert len(errors) == size + 1 and all("cancelled by the user" in str(e) for e in errors)
    assert len(worker_futures) == size  # the cancelled waiter never reached a worker
    assert all(isinstance(f.exception(timeout=120), CaptureCancelled) for f in worker_futures)  # each worker stopped
    load = admission().load("meta")
    assert (load.running, load.waiting) == (0, 0)


def _wait_until(predicate, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
