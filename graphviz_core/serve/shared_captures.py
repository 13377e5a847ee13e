"""One capture per config for everyone in the process: a cache bounded by bytes and entries, and captures in flight
that every session asking for the same config waits on, instead of capturing it again. Other long work the pages ask
for (a parallel simulation, a plan, a will-it-fit search: graphviz_core.serve.work) runs the same way, keyed by what
it computes (`request_work`): queued, cancelled with its last waiter, cached beside the captures under one limit.

A session asks with `request(config, waiter)`: it gets the cached result at once, or the `Job` capturing that
config (started on a worker thread if none runs yet; a meta dry run is handed from there to another process,
graphviz_core.capture.workers, so two of them run at once). A job's ticket goes through graphviz_core.capture.admission like
every capture; it is cancelled when its last waiter withdraws or when none of its waiters is alive any more.
Limits come from the environment:

    GRAPHVIZ_CORE_CACHE_MAX_BYTES     bytes the cached results may retain together (default 256 MiB)
    GRAPHVIZ_CORE_CACHE_MAX_ENTRIES   results kept at most (default 64)
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from graphviz_core.capture.admission import CaptureCancelled, Ticket, return_freed_memory
from graphviz_core.capture.device import resolve_device
from graphviz_core.capture.result import Capture
from graphviz_core.capture.workers import capture_anywhere
from graphviz_core.config import ModelConfig

log = logging.getLogger(__name__)

MAX_BYTES_ENV = "GRAPHVIZ_CORE_CACHE_MAX_BYTES"
MAX_ENTRIES_ENV = "GRAPHVIZ_CORE_CACHE_MAX_ENTRIES"
# A capture keeps about 2 KB per autograd node (measured: gpt2-tiny 101 nodes 0.21 MB, 12 layers 531 nodes 1.06 MB),
# so 256 MiB holds hundreds of everyday captures and still a few of the largest.
DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_MAX_ENTRIES = 64

_NOT_DATA = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def retained_bytes(obj: object) -> int:
    """Bytes of Python objects reachable from `obj` (each counted once; classes, modules and functions excluded).

    A capture holds no tensors, only its graph's dicts, strings and numbers, so this is what keeping it costs.
    """
    seen: set[int] = set()
    stack = [obj]
    total = 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _NOT_DATA):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        stack.extend(gc.get_referents(o))
    return total


def without_frames(exc: BaseException) -> BaseException:
    """`exc` (and the exceptions chained to it) without its traceback. A traceback holds every frame it passed
    through, and their locals: for a stopped capture, the model and its autograd graph. Kept with a Job, they would
    live as long as anyone holds the Job's error; the message is all a waiter shows."""
    seen: set[int] = set()
    chain: list[BaseException | None] = [exc]
    while chain:
        link = chain.pop()
        if link is not None and id(link) not in seen:
            seen.add(id(link))
            link.__traceback__ = None
            chain += [link.__cause__, link.__context__]
    return exc


# What a job runs: given a progress callback (what it does now, and how far along as a fraction when it knows) and
# its ticket (cancel, run time limit), it returns the result or raises.
Work = Callable[[Callable[..., None], Ticket], Any]


@dataclass(frozen=True)
class Eviction:
    """A result dropped from the cache to make room for another."""

    config: ModelConfig | None  # a capture's config; None for other work
    retained_bytes: int
    at: float  # time.time()
    what: str = ""  # the result in words


@dataclass(frozen=True)
class Cached:
    """A finished capture (or other result: `value`) as the cache holds it."""

    value: Any
    retained_bytes: int
    measured_at: float  # time.time() when the work finished
    evicted: tuple[Eviction, ...] = ()  # what was dropped to make room for it
    kept: bool = True  # False: larger than the whole cache, handed to its waiters but not kept
    what: str = ""
    config: ModelConfig | None = None  # a capture's config; None for other work

    @property
    def capture(self) -> Capture:
        return self.value


@dataclass
class Job:
    """One capture (or other work) in flight: its admission ticket, what it is doing, who waits for it, and how it
    ended."""

    config: ModelConfig | None  # the capture's config; None for other work
    ticket: Ticket
    started_at: float = field(default_factory=time.time)
    phase: str = "waiting for its turn"
    waiters: set[str] = field(default_factory=set)
    done: threading.Event = field(default_factory=threading.Event)
    result: Cached | None = None
    error: BaseException | None = None
    key: Hashable = None
    work: Work | None = None
    what: str = ""  # the work in words: "the capture of …", "the simulation of …"
    fraction: float | None = None  # how far along, where the work says

    def report(self, phase: str, fraction: float | None = None) -> None:
        """The work's progress callback."""
        self.phase, self.fraction = phase, fraction

    def ahead(self) -> int | None:
        """Captures ahead of this one in its device's queue; None once it runs."""
        return self.ticket.ahead()


@dataclass(frozen=True)
class CacheLoad:
    entries: int
    retained_bytes: int
    max_entries: int
    max_bytes: int
    in_flight: int


def cache_key(config: ModelConfig) -> ModelConfig:
    """The resolved config: `auto` becomes the device it runs on and the preset name (display only) is dropped, so
    gpt2-tiny picked by name, typed field by field, or on `cpu` rather than `auto` is one capture."""
    try:
        device = resolve_device(config.device)
    except ValueError:  # cuda asked for and missing: the capture itself refuses it with its sentence
        device = config.device
    return config.replace(device=device, preset="")


def _limit(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(float(raw)) if raw else default


class SharedCaptures:
    """The process's captures by config: cached ones (least recently used first) and jobs in flight."""

    def __init__(
        self,
        capture: Callable[..., Capture] = capture_anywhere,  # meta dry runs in another process, the rest here
        alive: Callable[[str], bool] = lambda waiter: True,
    ) -> None:
        self._capture = capture
        self.alive = alive  # is this waiter (a session id) still there?
        self._lock = threading.Lock()
        self._cached: OrderedDict[Hashable, Cached] = OrderedDict()  # a capture by its config, other work by its key
        self._jobs: dict[Hashable, Job] = {}

    def lookup(self, config: ModelConfig) -> Cached | None:
        return self.lookup_key(cache_key(config))

    def lookup_key(self, key: Hashable) -> Cached | None:
        with self._lock:
            cached = self._cached.get(key)
            if cached is not None:
                self._cached.move_to_end(key)
            return cached

    def request(self, config: ModelConfig, waiter: str) -> Cached | Job:
        """The cached capture of `config`, or the job capturing it (joined as `waiter`; started if none runs)."""

        def work(progress: Callable[..., None], ticket: Ticket) -> Capture:
            return self._capture(config, progress=progress, ticket=ticket)

        return self.request_work(cache_key(config), waiter, work, f"the capture of {config.describe()}", config)

    def request_work(self, key: Hashable, waiter: str, work: Work, what: str,
                     config: ModelConfig | None = None) -> Cached | Job:
        """The cached result for `key`, or the job computing it with `work` (joined as `waiter`; started on a thread
        of its own if none runs). `key` names what `work` computes, whole: equal keys share one result."""
        with self._lock:
            cached = self._cached.get(key)
            if cached is not None:
                self._cached.move_to_end(key)
                return cached
            job = self._jobs.get(key)
            if job is None or job.ticket.cancelled:  # a cancelled one still winding down is not joined
                job = Job(config, Ticket(), key=key, work=work, what=what)
                job.ticket.wanted = lambda: self._wanted(job)
                self._jobs[key] = job
                job.waiters.add(waiter)
                threading.Thread(target=self._run, args=(job,), name=f"capture-{job.ticket.id}", daemon=True).start()
            else:
                job.waiters.add(waiter)
            return job

    def withdraw(self, job: Job, waiter: str, reason: str = "cancelled by the user") -> bool:
        """`waiter` no longer waits for `job`; the capture is cancelled when nobody else does. True if cancelled."""
        with self._lock:
            job.waiters.discard(waiter)
            if job.waiters or job.done.is_set():
                return False
        job.ticket.cancel(reason)
        return True

    def cancel_all(self, reason: str) -> list[Job]:
        """Cancel every capture in flight (a server that is stopping); the jobs, to wait for."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.ticket.cancel(reason)
        return jobs

    def in_flight(self, config: ModelConfig) -> Job | None:
        return self.in_flight_key(cache_key(config))

    def in_flight_key(self, key: Hashable) -> Job | None:
        with self._lock:
            return self._jobs.get(key)

    def load(self) -> CacheLoad:
        with self._lock:
            return CacheLoad(
                len(self._cached),
                sum(c.retained_bytes for c in self._cached.values()),
                _limit(MAX_ENTRIES_ENV, DEFAULT_MAX_ENTRIES),
                _limit(MAX_BYTES_ENV, DEFAULT_MAX_BYTES),
                len(self._jobs),
            )

    def clear(self) -> None:
        with self._lock:
            self._cached.clear()

    def _wanted(self, job: Job) -> bool:
        with self._lock:
            waiters = list(job.waiters)
        return any(self.alive(w) for w in waiters)

    def _run(self, job: Job) -> None:
        try:
            value = job.work(job.report, job.ticket)
            job.result = self._keep(job.key, value, job.config, job.what)
        except CaptureCancelled as exc:
            job.error = without_frames(exc)
            log.info("%s cancelled: %s", job.what, exc)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter, shown there
            if not isinstance(exc, ValueError):
                log.exception("%s failed", job.what)
            job.error = without_frames(exc)
        finally:
            with self._lock:
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
            if job.error is not None:
                # What the stopped run built (the model, its activations) is garbage now that no frame holds it:
                # give it back, so a capture stopped by its user or the run time limit costs the server nothing.
                return_freed_memory()
            job.done.set()

    def keep(self, key: Hashable, value: Any, what: str) -> Cached:
        """Keep `value`, computed at once by the caller (a comparison of two cached captures), under `key`: counted
        with everything else (its whole retained bytes, the captures it holds included), evicted the same way."""
        return self._keep(key, value, None, what)

    def _keep(self, key: Hashable, value: Any, config: ModelConfig | None, what: str) -> Cached:
        size = retained_bytes(value)
        now = time.time()
        max_bytes = _limit(MAX_BYTES_ENV, DEFAULT_MAX_BYTES)
        max_entries = _limit(MAX_ENTRIES_ENV, DEFAULT_MAX_ENTRIES)
        with self._lock:
            if size > max_bytes or max_entries < 1:
                return Cached(value, size, now, kept=False, what=what, config=config)
            evicted = []
            held = sum(c.retained_bytes for c in self._cached.values())
            while self._cached and (held + size > max_bytes or len(self._cached) + 1 > max_entries):
                _, old = self._cached.popitem(last=False)
                held -= old.retained_bytes
                evicted.append(Eviction(old.config, old.retained_bytes, now, old.what))
            cached = Cached(value, size, now, tuple(evicted), what=what, config=config)
            self._cached[key] = cached
        for e in evicted:
            log.info("evicted %s (%d bytes) from the shared cache to make room", e.what, e.retained_bytes)
        return cached


_SHARED = SharedCaptures()


def shared_captures() -> SharedCaptures:
    """The process's one store of captures."""
    return _SHARED
