"""Meta dry runs in other processes, so that two of them run at once on two cores.

A capture on `meta` computes nothing: building the model, the hooks, the walk and the graph are all Python, so two
meta captures in one process take turns on the interpreter lock, and comparing two configs costs capture A + capture
B. In two processes they run side by side and the compare costs about the larger of the two, plus handing the result
back (a pickle of the Capture: Llama-3.1-70B's 6,500 nodes are 2.5 MB, 0.05 s to write and 0.04 s to read here).
In a server this also keeps a long dry run's Python off the interpreter every session's page runs on.

Only meta runs go elsewhere. CPU and CUDA captures measure time and reserve memory through the process's one
admission point; two at once on a shared machine would time each other.

Two ways to start the other process:
- `fork`, where this process runs no other Python thread (the CLI) and the machine has no GPU: the child starts at once with everything already
  imported, and is used for one capture;
- a pool of worker processes started by a `forkserver` otherwise (forking a server whose other threads may hold
  locks is unsafe). The fork server imports torch and every family's `transformers` modules once (about 4 s here, in
  its own process), and its workers stay alive. Until the pool has answered once, meta captures run here, while it
  starts in the background.

    GRAPHVIZ_CORE_META_PROCESSES   worker processes for meta runs (default: 2 where there are 2 or more cores, else 0;
                                   0 runs every meta capture in this process)

In a server every dry run goes through admission like a real capture (graphviz_core.capture.admission): a queue of
its own with visible positions, as many running at once as there are workers, the run time limit and Cancel. A dry
run stopped while a worker runs it is stopped there too: each task has a slot in an array the workers share, and the
worker's capture stops at its next module or node once the server sets it.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.context import ForkServerContext, ForkServerProcess

import torch

from graphviz_core.capture.admission import CaptureCancelled, Ticket, admit
from graphviz_core.capture.device import resolve_device
from graphviz_core.capture.engine import Progress, capture_backward
from graphviz_core.capture.gc_pause import no_cyclic_gc
from graphviz_core.capture.result import Capture
from graphviz_core.config import FAMILIES, ModelConfig

PROCESSES_ENV = "GRAPHVIZ_CORE_META_PROCESSES"
POLL_S = 0.05  # how often a wait for another process looks at its ticket (Cancel, a closed tab)
STOP_SLOTS = 256  # dry runs in flight in the worker processes that can be told to stop (more run unstoppable)
# Imported once by the fork server, so its workers start with them: the capture, and every family's own modules
# (resolving transformers' takes ~3 s in a fresh process, most of it the first family).
PRELOAD = [
    "graphviz_core.capture.engine",
    "graphviz_core.models.hf",
    "transformers.models.auto.modeling_auto",
    *(module for family in FAMILIES.values() for module in family.preload),
]


def pool_size() -> int:
    raw = os.environ.get(PROCESSES_ENV, "").strip()
    if raw:
        return max(0, int(raw))
    return 2 if (os.cpu_count() or 1) >= 2 else 0


def runs_elsewhere(config: ModelConfig) -> bool:
    """Whether `config` is a meta dry run that another process can take (a trusted-folder model is imported only by
    the server itself, so it stays here)."""
    if config.family.user_code or pool_size() == 0:
        return False
    try:
        return resolve_device(config.device) == "meta"
    except ValueError:  # the capture itself says why the device is refused
        return False


_STOP = None  # in a worker process: the array of stop flags the server shares with its workers
_CHECKED_IN = None  # in a worker process: how many of its pool's workers have answered the pool's first call
SERVER_GONE_POLL_S = 1.0  # how often a worker looks whether the server that started it is still there
CHECK_IN_WAIT_S = 120.0  # how long a worker holds its first call for the others (the fork server may import first)


def _worker_start(flags, server_pid: int, checked_in) -> None:
    """A worker's initializer: keep the server's stop flags, leave Ctrl-C to the server (which stops its workers
    itself; a KeyboardInterrupt here printed a traceback per worker), and exit once the server is gone.

    A worker outliving its server (killed with SIGKILL, or out of memory) would wait forever: it holds the write end
    of its own task queue, so it never reads an end of file there, and the fork server stays up while one of its
    children does. Both then held their memory (torch, transformers) and the fork server's socket indefinitely."""
    global _STOP, _CHECKED_IN
    _STOP, _CHECKED_IN = flags, checked_in
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(server_pid,), name="server-watch", daemon=True).start()


def _check_in(workers: int) -> int:
    """The pool's first call, one per worker: counted, then held until all `workers` have answered (or the server
    stops them, or CHECK_IN_WAIT_S passes). ProcessPoolExecutor starts another worker for a call only when none is
    idle, and a worker that answered at once was idle by the next call: the pool then ran one worker where it was
    asked for two (a fresh-clone test run found one worker beside the fork server, 120 s after the first dry run)."""
    with _CHECKED_IN.get_lock():
        _CHECKED_IN.value += 1
    deadline = time.monotonic() + CHECK_IN_WAIT_S
    while _CHECKED_IN.value < workers and time.monotonic() < deadline and not any(_STOP):
        time.sleep(0.02)
    return os.getpid()


def _exit_with(server_pid: int) -> None:
    while True:
        time.sleep(SERVER_GONE_POLL_S)
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:  # a process of another user took the number: the server is gone too
            os._exit(0)


def _capture_here(config: ModelConfig, slot: int = -1) -> bytes:
    """What the other process runs: one capture, pickled here so that this side unpickles it under `_loaded`; it
    stops (CaptureCancelled) once the server sets its stop flag `slot`."""
    ticket = None
    if slot >= 0 and _STOP is not None:
        flags = _STOP
        ticket = Ticket(wanted=lambda: not flags[slot])
    return pickle.dumps(capture_backward(config, ticket=ticket), protocol=pickle.HIGHEST_PROTOCOL)


def _loaded(data: bytes) -> Capture:
    """A capture from another process. Unpickling creates ~100,000 objects for Llama-3.1-70B, and the cyclic
    collector then walks every young object in this process again and again: 0.19-0.24 s, against 0.04 s paused."""
    with no_cyclic_gc():
        return pickle.loads(data)


class _WorkerProcess(ForkServerProcess):
    """A fork server's child told of no main module to run first.

    multiprocessing prepares each child by running the parent's `__main__` again, as `__mp_main__`. In a Streamlit
    server `__main__` is the module of the script run last (Streamlit installs it there), so each worker ran the whole
    app.py in bare mode: the app's imports and pages once more in every worker, and a screen of "missing
    ScriptRunContext" warnings from each in the server's log. A worker needs none of it: what it runs is unpickled
    by module name (graphviz_core.capture.workers)."""

    @staticmethod
    def _Popen(process_obj):
        main, bare = sys.modules.get("__main__"), types.ModuleType("__main__")  # no file, no name: nothing to run
        sys.modules["__main__"] = bare
        try:
            return ForkServerProcess._Popen(process_obj)
        finally:
            if sys.modules.get("__main__") is bare:  # else a script run installed its own meanwhile: keep that
                sys.modules["__main__"] = main


class _WorkerContext(ForkServerContext):
    Process = _WorkerProcess


class _Pool:
    """The server's worker processes, started in the background the first time a meta capture asks for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ProcessPoolExecutor | None = None
        self._ready = threading.Event()  # the workers answered
        self._settled = threading.Event()  # the last start ended, answered or not
        self._given_up = False  # a start failed (no fork server here): meta captures stay in this process
        self._spawned = threading.Event()  # the last start has launched its workers (or stopped launching them)
        self._spawned.set()
        self._stop = None  # STOP_SLOTS flags shared with every worker: 1 = stop the dry run in that slot
        self._free_slots = list(range(STOP_SLOTS))

    def ready(self) -> ProcessPoolExecutor | None:
        """The pool once its workers have answered; None until then (the first call starts it in the background)."""
        with self._lock:
            if self._executor is None and pool_size() > 0 and not self._given_up:
                self._settled.clear()
                self._spawned.clear()
                context = _WorkerContext()
                context.set_forkserver_preload(PRELOAD)
                if self._stop is None:
                    self._stop = context.RawArray("b", STOP_SLOTS)
                self._executor = ProcessPoolExecutor(
                    max_workers=pool_size(), mp_context=context, initializer=_worker_start,
                    initargs=(self._stop, os.getpid(), context.Value("i", 0)))
                threading.Thread(target=self._start, args=(self._executor,), name="meta-pool", daemon=True).start()
            return self._executor if self._ready.is_set() else None

    def submit(self, executor: ProcessPoolExecutor, config: ModelConfig) -> tuple[Future, int]:
        """`config`'s capture in a worker, and its stop slot (-1: none free); the slot is free again once the worker
        is done with it, stopped or not."""
        with self._lock:
            slot = self._free_slots.pop() if self._free_slots else -1
        try:
            future = executor.submit(_capture_here, config, slot)
        except BaseException:  # a broken or stopped pool takes nothing
            if slot >= 0:
                self._free(slot)
            raise
        if slot >= 0:
            future.add_done_callback(lambda _: self._free(slot))
        return future, slot

    def stop(self, slot: int) -> None:
        """Tell the worker running slot `slot`'s capture to stop at its next module or node."""
        if slot >= 0 and self._stop is not None:
            self._stop[slot] = 1

    def _free(self, slot: int) -> None:
        with self._lock:
            self._stop[slot] = 0
            self._free_slots.append(slot)

    def wait_ready(self, timeout: float | None = None) -> bool:
        if self.ready() is None and not self._given_up:
            self._settled.wait(timeout)
        return self._ready.is_set()

    def _start(self, executor: ProcessPoolExecutor) -> None:
        try:  # one call per worker starts them all: each is held until every worker has answered (_check_in), so
            # that no worker is idle when the next call is submitted and each submit spawns one more
            futures = []
            for _ in range(pool_size()):
                with self._lock:
                    if self._executor is not executor:  # shut down meanwhile: launch no more
                        return
                futures.append(executor.submit(_check_in, pool_size()))
            self._spawned.set()
            for future in futures:
                future.result()
            self._ready.set()
        except Exception:  # noqa: BLE001 - no pool: meta captures keep running here, and no start is tried again
            self._given_up = True
            self.broken(executor)
        finally:
            self._spawned.set()
            self._settled.set()

    def broken(self, executor: ProcessPoolExecutor) -> None:
        """Drop a pool whose worker died; the next meta capture starts a new one."""
        with self._lock:
            if self._executor is executor:
                self._executor = None
                self._ready.clear()
        executor.shutdown(wait=False, cancel_futures=True)

    def shut_down(self, timeout_s: float = 10.0) -> None:
        """Stop every dry run in the workers, end the workers (killed if they have not ended within `timeout_s`) and
        start no pool after this."""
        with self._lock:
            executor, self._executor = self._executor, None
            self._given_up = True
            self._ready.clear()
        if executor is None:
            return
        if self._stop is not None:
            self._stop[:] = [1] * STOP_SLOTS  # each running dry run stops at its next module or node
        deadline = time.monotonic() + timeout_s
        # A stop while the pool starts (the fork server imports torch first: seconds): a worker being launched is not
        # among the executor's processes yet, nobody stopped it, and the exit then waited for it forever
        # (multiprocessing joins its children at exit). Wait for the launch under way; launch no more.
        self._spawned.wait(max(0.0, deadline - time.monotonic()))
        processes = list((executor._processes or {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        # and any worker of ours still up, among them one whose launch outlasted the wait
        for process in {*processes, *(p for p in multiprocessing.active_children() if isinstance(p, _WorkerProcess))}:
            if process.is_alive():
                process.kill()
                process.join(5)


_POOL = _Pool()
atexit.register(_POOL.shut_down)


def shut_down_workers(timeout_s: float = 10.0) -> None:
    """Stop the server's worker processes (a server that is stopping): their dry runs stop, the workers end."""
    _POOL.shut_down(timeout_s)


def wait_for_pool(timeout: float | None = None) -> bool:
    """Start the worker processes if they are not, and wait until they answer (benchmarks and tests); False if they
    did not within `timeout` or this process runs meta captures itself (GRAPHVIZ_CORE_META_PROCESSES=0)."""
    return pool_size() > 0 and _POOL.wait_ready(timeout)


def capture_anywhere(config: ModelConfig, progress: Progress | None = None, ticket: Ticket | None = None) -> Capture:
    """`capture_backward(config)`, run by a worker process when it is a meta dry run and the pool is up.

    A dry run waits for its turn in admission's meta queue (as many at once as there are workers) and runs under the
    run time limit; a cancelled ticket stops the wait at once (CaptureCancelled) and the worker's capture at its next
    module or node. A pool that broke (a worker killed) is replaced, and this capture runs here instead.
    """
    if not runs_elsewhere(config):
        return capture_backward(config, progress, ticket)
    ticket = ticket or Ticket()
    with admit(config, "meta", ticket, at_once=pool_size()):
        executor = _POOL.ready()
        if executor is None:
            return capture_backward(config, progress, ticket)
        if progress is not None:
            progress("capturing in a second process (shapes only)")
        try:
            future, slot = _POOL.submit(executor, config)
        except (BrokenProcessPool, RuntimeError):  # a worker died, or the pool was stopped: capture here
            _POOL.broken(executor)
            return capture_backward(config, progress, ticket)
        return _answer(future, config, executor, owned=False, progress=progress, ticket=ticket, slot=slot)


def _answer(future: Future, config: ModelConfig, executor: ProcessPoolExecutor, owned: bool,
            progress: Progress | None = None, ticket: Ticket | None = None, slot: int = -1) -> Capture:
    """The capture `future` brings back; if its worker died (killed, out of memory), the server's pool is dropped
    (`owned`: the caller's own forked children, shut down by the caller) and `config` is captured here instead."""
    try:
        return _wait(future, ticket, slot)
    except BrokenProcessPool:
        if not owned:
            _POOL.broken(executor)
        return capture_backward(config, progress, ticket)


def _wait(future: Future, ticket: Ticket | None, slot: int = -1) -> Capture:
    while True:
        try:
            return _loaded(future.result(timeout=POLL_S))
        except CancelledError:  # still queued when the workers were stopped (a server that is stopping)
            raise CaptureCancelled("cancelled: the worker processes were stopped") from None
        except FutureTimeout:
            if ticket is not None:
                try:
                    ticket.check()
                except BaseException:
                    if not future.cancel():  # already running: the worker stops it at its next module or node
                        _POOL.stop(slot)
                    raise


def _has_accelerator() -> bool:
    """A GPU or other accelerator torch can use here (CUDA, MPS, XPU); asks without starting it. autograd keeps a
    thread per device of any such type once a backward has run. torch.accelerator from torch 2.6; CUDA alone before."""
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def _started(configs: list[ModelConfig]) -> tuple[dict[int, Callable[[], Capture]], Callable[[], None]]:
    """The meta dry runs among `configs`, started now elsewhere: {index: what returns its Capture}, and what to call
    once done. Forked children where no other Python thread runs (the CLI); in a server once its pool is up, each
    through capture_anywhere on a thread of its own (admission's queue, the run time limit, a stop that reaches the
    worker); otherwise none (they run here when asked for)."""
    elsewhere = [i for i, config in enumerate(configs) if runs_elsewhere(config)]
    if elsewhere and threading.active_count() == 1 and _has_accelerator():
        # Not forked on a machine with a GPU (or another accelerator: Apple's MPS, Intel's XPU): a forked child cannot
        # use CUDA once this process has (a meta capture that mirrors CUDA's kernels starts it: "Cannot re-initialize
        # CUDA in forked subprocess", seen on an H200 with `memory --device cuda --checkpoints`), nor run a backward at
        # all once this process has run one (even on the CPU, autograd then keeps a thread per GPU: "Unable to handle
        # autograd's threading in combination with fork-based multiprocessing", `memory --checkpoints` after another
        # capture on the H200). A fork server started for one command would outlive it: they run here.
        return {}, lambda: None
    if elsewhere and threading.active_count() == 1:
        children = ProcessPoolExecutor(max_workers=min(len(elsewhere), pool_size()),
                                       mp_context=multiprocessing.get_context("fork"))
        futures = {i: children.submit(_capture_here, configs[i]) for i in elsewhere}
        # its children have answered (or died): wait for its manager thread, so this process is as it was
        return ({i: functools.partial(_answer, future, configs[i], children, True) for i, future in futures.items()},
                functools.partial(children.shutdown, wait=True, cancel_futures=True))
    if not elsewhere or _POOL.ready() is None:
        return {}, lambda: None
    tickets = {i: Ticket() for i in elsewhere}
    threads = ThreadPoolExecutor(max_workers=len(elsewhere), thread_name_prefix="dry-run")
    futures = {i: threads.submit(capture_anywhere, configs[i], None, tickets[i]) for i in elsewhere}

    def done() -> None:  # a caller that gave up early stops the dry runs it no longer waits for
        for ticket in tickets.values():
            ticket.cancel("cancelled: nobody is waiting for it any more")
        threads.shutdown(wait=False)

    return {i: future.result for i, future in futures.items()}, done


def capture_many(configs: list[ModelConfig], progress: Progress | None = None) -> list[Capture]:
    """Every config's capture, in order. Meta dry runs start at once in other processes, side by side (forked
    children in the CLI, the pool in a server once it is up); the rest, and everything when there are no such
    processes, run here one after the other. A worker that died is replaced by a capture here."""
    started, done = _started(configs)
    try:
        captures = []
        for i, config in enumerate(configs):
            if progress is not None:
                progress(f"capturing {config.describe()}")
            captures.append(started[i]() if i in started else capture_backward(config))
        return captures
    finally:
        done()


def capture_later(config: ModelConfig) -> Callable[[], Capture]:
    """Start capturing `config` beside whatever this process does next; call the result for the Capture.

    A meta dry run, in a process with no other Python thread (the CLI), runs in a forked child from now on; in a
    server, in its pool once it is up; anything else is captured here when the result is asked for.
    """
    started, done = _started([config])
    if not started:
        return lambda: capture_backward(config)

    def result() -> Capture:
        try:
            return started[0]()
        finally:
            done()

    return result
