"""The simulation's world: torch's fake process group standing in for N ranks in this one process, the device meshes
a layout needs over it, and what keeps one simulation apart from any other.

The fake process group is process-global state: one simulation at a time (a lock), torn down after; DTensor's
sharding caches emptied where a request starts; the module trackers' process-global hooks kept to the simulating
thread. Parameters are made fake storages with `to_empty` (ties kept) once the model is wrapped.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphviz_core.capture import step_gate
from graphviz_core.capture.admission import CaptureCancelled
from graphviz_core.parallel.settings import ParallelConfig

_SIMULATION_LOCK = threading.Lock()
_ASKING = threading.local()  # per thread: the ticket that may stop the simulations this thread starts
# The running simulation's ticket (one at a time, under the lock), read from its rank threads, and whether it has
# stopped the simulation already: the ops its unwinding dispatches (a profiler range closed) must run, not raise again.
_RUNNING: list = [None, False]


@contextlib.contextmanager
def stopped_by(ticket) -> Iterator[None]:
    """The simulations this thread runs inside the block stop at their next op once `ticket` (an admission Ticket)
    is cancelled or past its run time limit: CaptureCancelled, raised out of the simulation, its world torn down."""
    previous = getattr(_ASKING, "ticket", None)
    _ASKING.ticket = ticket
    try:
        yield
    finally:
        _ASKING.ticket = previous


def _stop_within(exc: BaseException):
    """The stop (admission's CaptureCancelled: a cancelled or timed-out ticket) that `exc` is or wraps, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, CaptureCancelled):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def check_stopped() -> None:
    """Raise CaptureCancelled if the running simulation's ticket says stop (called at every op, in any rank's
    thread)."""
    ticket, stopped = _RUNNING
    if ticket is not None and not stopped:
        try:
            ticket.check()
        except BaseException:
            _RUNNING[1] = True
            raise


@contextlib.contextmanager
def simulation_lock() -> Iterator[None]:
    """The fake process group is process-global: one simulation at a time, in a process with no other group."""
    if not _SIMULATION_LOCK.acquire(timeout=600):
        raise ValueError("another parallel simulation has been running for 10 minutes; try again when it ends.")
    _RUNNING[:] = [getattr(_ASKING, "ticket", None), False]
    try:
        if dist.is_initialized():
            raise ValueError(
                "a torch.distributed process group is already running in this process; "
                "the simulation needs its own fake one."
            )
        with step_gate.shared(), _quiet(), _propagation_apart():  # never beside a compiled capture
            yield
    except Exception as exc:
        stop = _stop_within(exc)
        if stop is None or stop is exc:
            raise
        raise stop from None  # torch's pipeline stages raise "Failed to run stage backward" from what stopped them
    finally:
        _RUNNING[:] = [None, False]
        _SIMULATION_LOCK.release()


def forget_sharding_decisions() -> None:
    """Empty DTensor's sharding caches where a request starts (one layout, one plan), so that it runs as the first
    simulation of a process does, whatever ran before it (empty_sharding_caches says why). Refilling them made a
    llama-tiny FSDP+TP request 2.52 s instead of 2.24 (gpt2-tiny FSDP: 1.81 instead of 1.76)."""
    with simulation_lock():  # never while another simulation reads them
        empty_sharding_caches()


def empty_sharding_caches() -> None:
    """Empty DTensor's sharding caches (Python and C++); the caller holds the simulation lock. A cached decision is
    keyed by a mesh that equals any later mesh of the same shape and names made in a thread with the same id, so a
    simulation could reuse decisions from an earlier, torn-down world: in fresh-clone runs the planner's PP 2 x CP 2
    peak read 3,295,760 and 3,292,792 B against 3,258,768, the second time in a process of its own (a pipeline's rank
    threads can be given the ids of threads finished since). A pipeline simulation empties them before its rank
    threads start. Older torch releases have no function for it; there they stay."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()


@contextlib.contextmanager
def _propagation_apart() -> Iterator[None]:
    """DTensor works out an op's output shape, on a cache miss, by running it on fake copies of its inputs under the
    active fake mode: the simulation's own, so the memory tracker counted those copies as this rank's memory (seen:
    the first fsdp+tp step with full checkpointing in a process peaked 30,848 bytes above every later one, llama-tiny).
    The tracker leaves out ops under another fake mode (MemTracker.__torch_dispatch__), so propagation gets one of its
    own while a simulation runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    own = FakeTensorMode(allow_non_fake_inputs=True)
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: own
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # FSDP2 and the module trackers warn about hooks on model outputs that are not tensors; harmless here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@contextlib.contextmanager
def fake_world(parallel: ParallelConfig, rank: int = 0) -> Iterator[dict]:
    """The fake process group for `parallel.world_size` ranks (we are `rank`) and the meshes the layout needs."""
    if parallel.world_size == 1:
        yield {}
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # init_process_group wraps sys.excepthook to prefix "[rank0]: " to every line of an uncaught error, and nothing
    # unwraps it: after 100 simulations a server's traceback read "[rank0]: " 100 times per line, through 100 hooks.
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=parallel.world_size)
    try:
        yield build_meshes(parallel)
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def build_meshes(parallel: ParallelConfig) -> dict:
    """The device meshes `parallel` needs, over the process group already initialised (fake or real).

    Built outside FakeTensorMode: a mesh's rank table is a real tensor (torchtitan builds them first too).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world, tp = parallel.world_size, parallel.tp
    if parallel.pp > 1:
        return _pipeline_meshes(parallel)
    if parallel.cp > 1:
        return _context_meshes(parallel)
    if parallel.strategy == "none":
        return {}
    if parallel.strategy == "fsdp+tp":
        # TP innermost: its ranks are neighbours (one node, NVLink); FSDP strides across nodes.
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        return {"dp": mesh["dp"], "tp": mesh["tp"], "root": mesh}
    if parallel.strategy == "tp":
        return {"tp": init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))}
    if parallel.strategy == "hsdp":
        shard = parallel.shard_group
        mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        return {"dp": mesh, "root": mesh}
    return {"dp": init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))}


def _context_meshes(parallel: ParallelConfig) -> dict:
    """Data x context (x tensor, innermost) as torchtitan lays its mesh out; FSDP / DDP run over data and context
    ranks flattened into one dimension (torchtitan's "dp_shard_cp"), since every context rank holds gradients of
    its own part of the sequence."""
    from torch.distributed.device_mesh import init_device_mesh

    cp, tp = parallel.cp, parallel.tp
    dims = {"dp": parallel.world_size // (cp * tp), "cp": cp}
    if tp > 1:
        dims["tp"] = tp
    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    meshes = {"root": mesh, "dp": mesh["dp", "cp"]._flatten("dp_cp"), "cp": mesh["cp"]}
    if tp > 1:
        meshes["tp"] = mesh["tp"]
    return meshes


def _pipeline_meshes(parallel: ParallelConfig) -> dict:
    """Pipeline stages outermost (as torchtitan orders its mesh: pp, then data parallel, then tp innermost), so each
    stage's ranks are neighbours; the strategy's meshes are slices of it. Context parallel adds its dimension between
    data and tensor ranks (torchtitan's pp, dp, cp, tp) and FSDP / DDP span data x context ranks, as without a
    pipeline (_context_meshes)."""
    from torch.distributed.device_mesh import init_device_mesh

    inner = parallel.world_size // parallel.pp
    strategy, tp, cp = parallel.strategy, parallel.tp, parallel.cp
    if cp > 1:
        dims = {"pp": parallel.pp, "dp": inner // (cp * tp), "cp": cp, **({"tp": tp} if tp > 1 else {})}
        mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
        meshes = {"pp": mesh["pp"], "root": mesh, "dp": mesh["dp", "cp"]._flatten("dp_cp"), "cp": mesh["cp"]}
        return {**meshes, "tp": mesh["tp"]} if tp > 1 else meshes
    if strategy == "fsdp+tp":
        dims = {"pp": parallel.pp, "dp": inner // tp, "tp": tp}
    elif strategy == "tp":
        dims = {"pp": parallel.pp, "tp": tp}
    elif strategy == "hsdp":
        dims = {"pp": parallel.pp, "replicate": inner // parallel.shard_group, "shard": parallel.shard_group}
    elif strategy == "none":
        dims = {"pp": parallel.pp}
    else:
        dims = {"pp": parallel.pp, "dp": inner}
    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    meshes = {"pp": mesh["pp"], "root": mesh}
    if strategy == "hsdp":
        meshes["dp"] = mesh["replicate", "shard"]
    elif "dp" in dims:
        meshes["dp"] = mesh["dp"]
    if "tp" in dims:
        meshes["tp"] = mesh["tp"]
    return meshes


def group_names(meshes: dict) -> dict[str, str]:
    names = {}
    for key, mesh in meshes.items():
        if key == "root":
            continue
        for dim, dim_name in enumerate(mesh.mesh_dim_names):
            names[mesh.get_group(dim).group_name] = dim_name
    return names


def to_empty_keeping_ties(model: nn.Module) -> None:
    """`to_empty` replaces parameters module by module, which splits a tied pair (GPT-2's wte / lm_head) into
    two; tie them again so that the model holds one tensor, as the real one does."""
    tied: dict[int, list[tuple[nn.Module, str]]] = {}  # id(parameter) -> every (module, name) holding it
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            tied.setdefault(id(param), []).append((module, name))
    model.to_empty(device="cpu")
    for owners in tied.values():
        first_module, first_name = owners[0]
        for module, name in owners[1:]:
            setattr(module, name, getattr(first_module, first_name))


@torch.no_grad()
def fill_small(model: nn.Module) -> None:
    """to_empty leaves real storages uninitialised; any finite values do for sizes and collectives."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        local.normal_(0.0, 0.02)


def running_of(held: list, phase: str, position: Callable[[Any], int]):
    """Of the modules torch's module tracker holds at once, the one running. Its `parents` is a set that can keep a
    module whose end it has not seen yet (one layer's backward begun before the previous layer's is seen to end), and
    a set of names iterates in an order that follows string hashes, different in every process: the one running is
    furthest along the model's order (`position`), the last in forward, the first in backward."""
    return (min if phase == "backward" else max)(held, key=position)


def this_thread_only(module_tracker) -> None:
    """ModTracker's forward hooks are global to the process (register_module_forward_pre_hook): a capture running
    in another session's thread would have its modules, and through MemTracker's hooks their parameters, counted
    in this rank's memory. Keep the hooks to the simulating thread; dispatch modes are per thread already."""
    owner = threading.get_ident()
    for name in ("_fw_pre_hook", "_fw_post_hook"):
        hook = getattr(module_tracker, name)

        def guarded(*args, _hook=hook):
            if threading.get_ident() == owner:
                return _hook(*args)
            return None

        setattr(module_tracker, name, guarded)


def mesh_sizes(meshes: dict, parallel: ParallelConfig) -> dict[str, int]:
    """Mesh dimension -> ranks along it, read outside fake mode (a mesh's rank table is a real tensor). Context
    parallel: data, context (and tensor) ranks, then their flattened union (FSDP's group, "dp_cp")."""
    sizes = {}
    for key, mesh in meshes.items():
        if key != "root" or parallel.cp > 1:
            sizes.update(zip(mesh.mesh_dim_names, mesh.mesh.shape, strict=True))
    return sizes
