"""One admission point for every capture in the process: memory reservations per device, a compute budget,
a first-in-first-out queue with visible positions, cancellation, and returning freed memory to the OS.

Every capture calls `admit(config, device, ticket)` before it builds anything. A real capture reserves its
estimated peak bytes (`device.estimate_peak_bytes`) against its device's budget and releases them when it
ends, so captures running side by side can never plan to use more than the budget together; one that does
not fit yet waits its turn. CUDA runs one capture at a time per GPU on top of the byte reservation: a capture
asked for on "cuda" is placed on one GPU, "cuda:N", of those allowed (graphviz_core.capture.device.cuda_devices:
CUDA_VISIBLE_DEVICES, then GRAPHVIZ_CORE_GPUS), the one where it starts soonest (fewest captures running or
waiting there), then the one with the most room (its budget minus what is reserved there); each GPU has its own
budget and queue.
`meta` dry runs allocate no tensor memory but can run for minutes: they have a queue of their own (never behind
real captures), as many at once as the caller says can run side by side (graphviz_core.capture.workers: one per
worker process), and the same run time limit, cancel and queue timeout. Parallel simulations (fake tensors over a
fake process group; a plan is many) queue as `SIMULATION`, one at a time: the fake process group is the process's.

Budgets (bytes) come from the container's memory limit (cgroup v2 `memory.max`, v1
`memory.limit_in_bytes`) and `MemAvailable`, whichever leaves less room, or from the environment:

    GRAPHVIZ_CORE_CPU_BUDGET_BYTES, GRAPHVIZ_CORE_CUDA_BUDGET_BYTES   total bytes all captures may reserve
    GRAPHVIZ_CORE_CAPTURE_MAX_BYTES      largest single capture (one session's share); default: the budget
    GRAPHVIZ_CORE_COMPUTE_BUDGET_S       longest estimated run, in seconds (default 60)
    GRAPHVIZ_CORE_CPU_FLOPS_PER_S, GRAPHVIZ_CORE_CUDA_FLOPS_PER_S   throughput the time estimate assumes
    GRAPHVIZ_CORE_QUEUE_TIMEOUT_S        longest wait in the queue before giving up (default 600)
    GRAPHVIZ_CORE_RUN_TIMEOUT_S          longest a capture may run before it is cancelled (default 900)
    GRAPHVIZ_CORE_MAX_WAITING            most captures waiting at once on one device (default 32)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from graphviz_core.capture.device import (
    CaptureError,
    check_budget,
    cuda_devices,
    cuda_index,
    estimate_peak_bytes,
    estimate_training_flops,
    memory_budget_bytes,
)
from graphviz_core.config import ModelConfig

log = logging.getLogger(__name__)

CAPTURE_MAX_ENV = "GRAPHVIZ_CORE_CAPTURE_MAX_BYTES"
COMPUTE_BUDGET_ENV = "GRAPHVIZ_CORE_COMPUTE_BUDGET_S"
FLOPS_PER_S_ENV = {"cpu": "GRAPHVIZ_CORE_CPU_FLOPS_PER_S", "cuda": "GRAPHVIZ_CORE_CUDA_FLOPS_PER_S"}
QUEUE_TIMEOUT_ENV = "GRAPHVIZ_CORE_QUEUE_TIMEOUT_S"
RUN_TIMEOUT_ENV = "GRAPHVIZ_CORE_RUN_TIMEOUT_S"
MAX_WAITING_ENV = "GRAPHVIZ_CORE_MAX_WAITING"

DEFAULT_COMPUTE_BUDGET_S = 60.0
# What the time estimate assumes a capture sustains, instrumentation included. CPU: gpt2-small (b=1, s=1024,
# 8.9e11 estimated FLOPs) captured in about 23 s on this 2-core machine = 3.9e10 FLOP/s. CUDA: a quarter of
# an H100's dense bf16 peak would be ~2.5e14; 2e13 stays conservative for float32 and small kernels.
DEFAULT_FLOPS_PER_S = {"cpu": 4e10, "cuda": 2e13}
# Trimming costs a few milliseconds; below this a capture leaves too little behind to be worth it.
TRIM_ABOVE_BYTES = 256 * 2**20
SIMULATION = "simulation"  # the queue of parallel simulations: fake tensors, no bytes reserved, one at a time
POLL_S = 0.25  # how often a waiting or running capture looks at its cancel conditions


class CaptureCancelled(Exception):
    """The capture was cancelled (by its user, a closed session, or the run time limit) and freed."""


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else default


class Ticket:
    """One capture's place in the admission queue and its cancel switch (thread-safe).

    `wanted`, when given, is asked every POLL_S while the capture waits or runs; returning False cancels it
    (the app passes "is any session that asked for this still connected?").
    """

    _ids = itertools.count(1)

    def __init__(self, wanted: Callable[[], bool] | None = None) -> None:
        self.id = next(self._ids)
        self.wanted = wanted
        self.state = "new"  # new -> waiting -> running -> done | cancelled | refused
        self.device: str | None = None
        self.reserved_bytes = 0
        self.reason = ""
        self._cancelled = threading.Event()
        self._deadline: float | None = None
        self._next_poll = 0.0
        self._admission: Admission | None = None

    def cancel(self, reason: str = "cancelled") -> None:
        if not self._cancelled.is_set():
            self.reason = reason
            self._cancelled.set()
            if self._admission is not None:
                self._admission.wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def ahead(self) -> int | None:
        """Captures ahead of this one in its device's queue (running ones included); None once it runs."""
        if self._admission is None or self.state != "waiting":
            return None
        return self._admission.ahead_of(self)

    def check(self) -> None:
        """Raise CaptureCancelled when the capture should stop. Cheap: called at every autograd node."""
        if self._cancelled.is_set():
            raise CaptureCancelled(self.reason)
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + POLL_S
        if self._deadline is not None and now > self._deadline:
            self.cancel(f"stopped after the server's run time limit of {_env_float(RUN_TIMEOUT_ENV, 900):g} s")
        elif self.wanted is not None and not self.wanted():
            self.cancel("cancelled: nobody is waiting for it any more")
        if self._cancelled.is_set():
            raise CaptureCancelled(self.reason)


@dataclass
class _DeviceQueue:
    budget_bytes: int | None = None  # snapshot taken while nothing of ours is reserved on the device
    reserved_bytes: int = 0
    running: int = 0
    waiting: deque = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.waiting = deque()


@dataclass(frozen=True)
class DeviceLoad:
    """What one device's admission looks like right now."""

    device: str
    budget_bytes: int | None
    reserved_bytes: int
    running: int
    waiting: int


@dataclass(frozen=True)
class TrimReport:
    """Resident memory of this process around the last return of freed memory to the OS."""

    rss_before_bytes: int
    rss_after_bytes: int


class Admission:
    """The process-wide admission controller (use the module's `admit`, which shares one instance)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._devices: dict[str, _DeviceQueue] = {}
        self.last_trim: TrimReport | None = None

    def wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def ahead_of(self, ticket: Ticket) -> int:
        with self._lock:
            queue = self._devices.get(ticket.device or "")
            if queue is None or ticket not in queue.waiting:
                return 0
            return queue.running + list(queue.waiting).index(ticket)

    def load(self, device: str) -> DeviceLoad:
        with self._lock:
            q = self._devices.get(device) or _DeviceQueue()
            return DeviceLoad(device, q.budget_bytes, q.reserved_bytes, q.running, len(q.waiting))

    @contextlib.contextmanager
    def admit(
        self, config: ModelConfig, device: str, ticket: Ticket | None = None, at_once: int | None = None
    ) -> Iterator[Ticket]:
        """Hold a place for `config` on `device` for the duration of the block.

        `device`: "cpu", "meta", one GPU ("cuda:N"), or "cuda": placed on one of the GPUs it may use (see the
        module's docstring); the ticket's `device` then says which, "cuda:N".
        `at_once`: how many captures may run on `device` at once (default: CUDA 1, CPU as many as the budget holds,
        meta 1). A ticket already holding its place on `device` (a dry run taken back from a worker process that
        died) keeps it: admitting it again waits for nothing.

        Raises CaptureError (a sentence) for a config that can never run here, CaptureCancelled when the
        ticket is cancelled while waiting, and CaptureError when the wait exceeds the queue timeout.
        """
        ticket = ticket or Ticket()
        placed = ticket.device == device or (device == "cuda" and cuda_index(ticket.device or "") is not None)
        if ticket.state == "running" and placed:
            yield ticket
            return
        ticket.device = device
        ticket._admission = self
        shapes_only = device in ("meta", SIMULATION)
        need = 0 if shapes_only else estimate_peak_bytes(config)
        if not shapes_only:
            self._refuse_if_impossible(config, device, need)
        default = {"cuda": 1, "meta": 1, SIMULATION: 1}.get(device.partition(":")[0])
        self._wait_for_room(ticket, device, need, at_once or default)
        device = ticket.device  # "cuda" was placed on one GPU, "cuda:N"
        run_limit = _env_float(RUN_TIMEOUT_ENV, 900)
        ticket._deadline = time.monotonic() + run_limit if run_limit > 0 else None
        try:
            ticket.check()
            yield ticket
        finally:
            ticket.state = "cancelled" if ticket.cancelled else "done"
            with self._lock:
                queue = self._devices[device]
                queue.reserved_bytes -= need
                queue.running -= 1
                ticket.reserved_bytes = 0
                self._lock.notify_all()
            if device == "cpu" and need >= TRIM_ABOVE_BYTES:
                self.last_trim = return_freed_memory()

    def _refuse_if_impossible(self, config: ModelConfig, device: str, need: int) -> None:
        if device == "cuda":  # it must fit on at least one of the GPUs it may be placed on
            budget = max(self._budget(gpu) for gpu in cuda_devices())
        else:
            budget = self._budget(device)
        check_budget(config, device, budget=budget)
        cap = _env_float(CAPTURE_MAX_ENV, 0)
        if cap and need > cap:
            raise CaptureError(
                f"this config needs about {need / 2**30:.1f} GiB but this server allows one capture at most "
                f"{cap / 2**30:.1f} GiB ({CAPTURE_MAX_ENV}); lower batch or seq, or run it on device 'meta'."
            )
        flops = estimate_training_flops(config)
        kind = device.partition(":")[0]
        rate = _env_float(FLOPS_PER_S_ENV[kind], DEFAULT_FLOPS_PER_S[kind])
        limit = _env_float(COMPUTE_BUDGET_ENV, DEFAULT_COMPUTE_BUDGET_S)
        seconds = flops / rate
        if seconds > limit:
            raise CaptureError(
                f"this config needs about {flops:.2g} FLOPs, roughly {_duration(seconds)} on {device} at "
                f"{rate:.2g} FLOP/s, and this server stops at {limit:g} s ({COMPUTE_BUDGET_ENV}); lower seq, "
                f"batch or layers, or run it on device 'meta' (shapes only)."
            )

    def _budget(self, device: str) -> int:
        with self._lock:
            queue = self._devices.setdefault(device, _DeviceQueue())
            # Measure free memory only while none of our captures holds any: otherwise their own
            # allocations would be subtracted twice (once as reserved, once as used).
            if queue.budget_bytes is None or (queue.reserved_bytes == 0 and not queue.waiting):
                queue.budget_bytes = memory_budget_bytes(device)
            return queue.budget_bytes

    def _pick_gpu(self, need: int) -> str:
        """The allowed GPU where a capture of `need` bytes starts soonest (fewest captures running or waiting
        there), then the one with the most room (budget minus reserved), then the lowest index. Holds the lock."""
        with self._lock:
            loads = []
            for gpu in cuda_devices():
                budget = self._budget(gpu)
                queue = self._devices[gpu]
                if need <= budget:
                    busy = queue.running + len(queue.waiting)
                    loads.append((busy, -(budget - queue.reserved_bytes), cuda_index(gpu), gpu))
            if not loads:
                raise CaptureError(
                    f"this config needs about {need / 2**30:.1f} GiB and no GPU it may use has that much free "
                    f"memory now; lower batch or seq, or run it on device 'meta' (shapes only)."
                )
            return min(loads)[-1]

    def _wait_for_room(self, ticket: Ticket, device: str, need: int, at_once: int | None) -> None:
        timeout = _env_float(QUEUE_TIMEOUT_ENV, 600)
        max_waiting = int(_env_float(MAX_WAITING_ENV, 32))
        started = time.monotonic()
        with self._lock:
            if device == "cuda":  # placed and queued under one hold of the lock: two captures see each other
                device = ticket.device = self._pick_gpu(need)
            queue = self._devices.setdefault(device, _DeviceQueue())  # meta's: no budget, never measured
            if len(queue.waiting) >= max_waiting:
                raise CaptureError(
                    f"{len(queue.waiting)} captures are already waiting on {device}; try again in a minute."
                )
            queue.waiting.append(ticket)
            ticket.state = "waiting"
            try:
                while True:
                    if ticket.cancelled:
                        raise CaptureCancelled(ticket.reason)
                    fits = queue.budget_bytes is None or queue.reserved_bytes + need <= queue.budget_bytes
                    free = at_once is None or queue.running < at_once
                    # First come, first served: only the head of the queue may start.
                    if queue.waiting[0] is ticket and fits and free:
                        break
                    if time.monotonic() - started > timeout:
                        raise CaptureError(
                            f"waited {timeout:g} s for room on {device} behind {self.ahead_of(ticket)} other "
                            f"capture(s); the server is busy, try again later."
                        )
                    self._lock.wait(POLL_S)
                    self._lock.release()
                    try:
                        ticket.check()  # asks `wanted` outside the lock
                    finally:
                        self._lock.acquire()
            except BaseException:
                queue.waiting.remove(ticket)
                ticket.state = "cancelled" if ticket.cancelled else "refused"
                self._lock.notify_all()
                raise
            queue.waiting.popleft()
            queue.reserved_bytes += need
            queue.running += 1
            ticket.reserved_bytes = need
            ticket.state = "running"
            self._lock.notify_all()


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / 3600:.0f} hours"


_ADMISSION = Admission()


def admission() -> Admission:
    """The process's one admission controller."""
    return _ADMISSION


def admit(config: ModelConfig, device: str, ticket: Ticket | None = None, at_once: int | None = None):
    """`Admission.admit` on the process's one controller."""
    return _ADMISSION.admit(config, device, ticket, at_once)


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def return_freed_memory() -> TrimReport:
    """Collect garbage and ask glibc to give freed heap pages back to the OS (a no-op elsewhere).

    After a big capture glibc keeps its arenas mapped (a 256-layer capture left 7.3 GB resident), which
    would shrink the room every later budget measures; malloc_trim(0) returns them.
    """
    before = rss_bytes()
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    after = rss_bytes()
    log.info("returned freed memory to the OS: RSS %.0f MiB -> %.0f MiB", before / 2**20, after / 2**20)
    return TrimReport(before, after)


_TRIM: list = []


def _malloc_trim():
    if not _TRIM:
        fn = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = getattr(libc, "malloc_trim", None)  # glibc only; musl and macOS have none
            if fn is not None:
                fn.argtypes = [ctypes.c_size_t]
                fn.restype = ctypes.c_int
        except OSError:
            fn = None
        _TRIM.append(fn)
    return _TRIM[0]
