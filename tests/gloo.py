"""Real processes over gloo on CPU, for the tests that check the simulation against torch's own distributed step."""

from __future__ import annotations

import contextlib
import queue
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphviz_core.config import ModelConfig
from graphviz_core.parallel.report import PerRank
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.parallel.simulate import measure_step, workload_of
from graphviz_core.parallel.world import build_meshes


@contextlib.contextmanager
def _no_main_script() -> Iterator[None]:
    """A spawned rank imports its function by module name and need not run the parent's `__main__`. Under pytest,
    Streamlit's AppTest leaves `sys.modules["__main__"]` as its own script module (a temporary file calling
    `_compare_app(*__args, ...)`), which a spawned child then ran and died on (NameError), so the rank never reported:
    an FSDP test failed after tests/test_timing_notice.py in the same worker and passed alone."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


# What every rank imports, once, in the fork server the ranks are forked from (multiprocessing's "forkserver" start
# method): a rank started fresh ("spawn") paid about 2.5 s of CPU importing torch, transformers and this package before
# its first line; forked from a server that imported them once, it starts at once. The server is one per pytest process,
# shared with the capture pool's workers (graphviz_core.capture.workers.PRELOAD, when that pool started it first).
RANK_PRELOAD = ["tests.gloo", "graphviz_core.capture.engine", "graphviz_core.models.hf",
                "transformers.models.auto.modeling_auto", "torch.distributed.fsdp", "torch.distributed.tensor.parallel"]


def spawn_ranks(rank_fn: Callable, world: int, *args, timeout: float = 120):
    """Run `rank_fn(rank, world, port, *args, results)` in `world` real processes; what rank 0 puts on `results`.
    The queue is read before the processes are joined: rank 0 flushes it on exit.

    The ranks' rendezvous (a TCPStore) is served from this process on a port it holds from the start: a port found
    free and let go, for rank 0 to bind seconds later once spawned, could be taken meanwhile by any connection on the
    machine (the browser tests' make hundreds); rank 0 then failed to bind, rank 1 waited for it, and the test ran out
    its timeout with no result (tests/test_parallel_lora.py's TP + SP run, once in a fresh-clone suite, never alone).
    A rank that raised is reported with its traceback; one that hangs is stopped."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=world, is_master=True, wait_for_workers=False)
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)  # kept by the fork server only if this starts it (else PRELOAD's)
    results = context.Queue()
    with _no_main_script():
        ranks = mp.start_processes(rank_fn, args=(world, store.port, *args, results), nprocs=world,
                                   start_method="forkserver", join=False)
    deadline = time.monotonic() + timeout
    while True:
        try:
            out = results.get(timeout=1)
            break
        except queue.Empty:
            # a rank that raised or died: ProcessRaisedException (its traceback) or ProcessExitedException, at once
            if ranks.join(timeout=0):
                out = results.get(timeout=10)  # every rank ended cleanly: rank 0's result is on its way
                break
            if time.monotonic() > deadline:
                for process in ranks.processes:
                    process.kill()
                raise TimeoutError(f"no result from the {world} ranks within {timeout:g} s; none raised: they "
                                   "hung") from None
    while not ranks.join():
        pass
    del store  # held until the ranks are done with it
    return out


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[None]:
    """This rank's gloo process group (one CPU thread per rank), torn down when both ranks are done with it: a rank
    tearing gloo down while the other still talks to it aborted (SIGABRT, "terminate called without an active
    exception") on a loaded machine, after the results had come back."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=False)  # served by spawn_ranks' process
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        yield
        dist.barrier()  # not after an error: the other rank would wait here for one that never comes
    finally:
        dist.destroy_process_group()


def _fsdp_rank(rank: int, world: int, port: int, config: ModelConfig, results) -> None:
    with gloo_group(rank, world, port):
        parallel = ParallelConfig("fsdp", world)
        measured = measure_step(workload_of(config), parallel, build_meshes(parallel), config=config, fake=False)
        if rank == 0:
            results.put(measured)


def fsdp_over_gloo(config: ModelConfig, world: int) -> PerRank:
    """Rank 0's figures of one real FSDP2 training step of `config` over `world` processes (real tensors, gloo)."""
    return spawn_ranks(_fsdp_rank, world, config)
