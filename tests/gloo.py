"""Real processes over gloo on CPU, for the tests that check the simulation against torch's own distributed step."""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphviz_core.config import ModelConfig
from graphviz_core.parallel.report import PerRank
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.parallel.simulate import measure_step, workload_of
from graphviz_core.parallel.world import build_meshes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def spawn_ranks(rank_fn: Callable, world: int, *args, timeout: float = 120):
    """Run `rank_fn(rank, world, port, *args, results)` in `world` real processes; what rank 0 puts on `results`.
    The queue is read before the processes are joined: rank 0 flushes it on exit."""
    results = mp.get_context("spawn").Queue()
    with _no_main_script():
        ranks = mp.start_processes(rank_fn, args=(world, free_port(), *args, results), nprocs=world,
                                   start_method="spawn", join=False)
    out = results.get(timeout=timeout)
    while not ranks.join():
        pass
    return out


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[None]:
    """This rank's gloo process group (one CPU thread per rank), torn down when both ranks are done with it: a rank
    tearing gloo down while the other still talks to it aborted (SIGABRT, "terminate called without an active
    exception") on a loaded machine, after the results had come back."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
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
