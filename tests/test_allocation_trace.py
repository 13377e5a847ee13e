"""The allocation recorder (graphviz_core.parallel.allocation_trace): a hand-counted sequence of ops, and a real
FSDP2 step of llama-tiny whose recorded peak must equal the simulation's own (torch's MemTracker, a separate
tracker) and whose side-stream allocations must be the collectives' buffers (CollectiveRecorder, a third)."""

from __future__ import annotations

from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphviz_core.analysis.allocator import replay
from graphviz_core.config import resolve_config
from graphviz_core.parallel.allocation_trace import AllocationRecorder
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.parallel.simulate import measure_step, workload_of
from graphviz_core.parallel.world import fake_world, simulation_lock


def test_each_new_storage_is_an_allocation_and_its_last_tensor_frees_it():
    resize = torch.UntypedStorage.resize_
    with FakeTensorMode():
        x = torch.empty(1000)  # float32: 4000 B, there before recording
        with AllocationRecorder([x]) as recorder:
            y = x * 2  # a new storage: 4000 B
            z = y.view(10, 100)  # a view shares y's storage: nothing new
            w = torch.cat([y, y])  # 2000 floats: 8000 B
            del y  # z still holds the storage
            del z  # the storage's last tensor: freed
            t = torch.empty(0)  # no bytes: not an allocation
            t.untyped_storage().resize_(400)  # FSDP2's way to allocate: 0 -> 400 B
            t.untyped_storage().resize_(0)  # and to free
        trace = recorder.trace()
    assert torch.UntypedStorage.resize_ is resize  # put back on leaving
    assert trace.step_start == 1
    assert trace.events == (
        ("alloc", 0, 4000, "default"),
        ("alloc", 1, 4000, "default"),
        ("alloc", 2, 8000, "default"),
        ("free", 1),
        ("alloc", 3, 400, "default"),
        ("free", 3),
    )
    assert trace.peak_bytes() == 4000 + 4000 + 8000
    del w


def test_an_fsdp_step_records_the_simulations_peak_and_the_collectives_buffers_on_their_streams():
    config = resolve_config("llama-tiny")  # float32 master weights
    parallel = ParallelConfig("fsdp", 2, mixed_precision="bf16-fp32-reduce")
    traces = []
    with simulation_lock(), fake_world(parallel) as meshes:
        result = measure_step(workload_of(config), parallel, meshes, config=config, on_allocations=traces.append)
    trace = traces[0]
    # The recorder's running maximum and MemTracker's per-op peak count the same storages at the same moments.
    assert trace.peak_bytes() == result.peak_bytes
    names = {label: name for label, name in trace.streams.items()}
    by_stream = {name: Counter() for name in names.values()}
    for event in trace.events:
        if event[0] == "alloc":
            by_stream[names[event[3]]][event[2]] += 1
    gathers = [c.buffer_bytes for c in result.collectives if c.kind == "all_gather"]
    scatters = [c.buffer_bytes for c in result.collectives if c.kind == "reduce_scatter"]
    # FSDP2's foreach_all_gather, on the copy-in stream: each gather's output (buffer_bytes, both ranks' bf16
    # shards) and its input (this rank's shard cast to bf16: half of it over 2 ranks).
    assert by_stream["FSDP2 all gather copy in stream"] == Counter(gathers) + Counter(b // 2 for b in gathers)
    # foreach_reduce: the input is filled on the default stream; the output (this rank's float32 half, which becomes
    # the sharded gradient) is allocated on the reduce-scatter stream.
    assert by_stream["FSDP2 reduce scatter stream"] == Counter(b // 2 for b in scatters)
    # The replay checks its own requested peak against the trace's (replay raises otherwise).
    estimate = replay(trace)
    assert estimate.peak_requested_bytes == result.peak_bytes
    # Three streams (default, all-gather copy-in, reduce-scatter), each with its first 2 MiB small segment at least.
    assert estimate.peak_reserved_bytes >= 3 * 2 * 2**20
