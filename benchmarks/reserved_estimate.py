"""An ESTIMATE of the CUDA caching allocator's reserved memory for one rank's training step, without a GPU: the
step runs on fake tensors (graphviz_core.parallel.simulate), every storage it allocates and frees is recorded in
order with its stream (graphviz_core.parallel.allocation_trace), and that sequence is replayed through the
allocator's rules (graphviz_core.analysis.allocator). A replay of the rules, not a measurement on a GPU.

The default layout is torchtitan's first context-parallel row of Llama 3.1 8B on 8 H100s (its
benchmarks/llama3_h100_202412_torchtitan.md, Table 2): FSDP over 8 ranks, one sequence of 32,768 tokens per rank,
full activation checkpointing, float32 master weights with bf16 compute and float32 gradient reduction, AdamW, and
the loss on the logits upcast to float32, as torchtitan's `cross_entropy(pred.flatten(0, 1).float(), labels)` and
Hugging Face's ForCausalLMLoss compute it (the simulation's own loss for transformers language models, the same bytes:
the float32 copy is made before the flatten rather than after). torch.compile and Float8 are not run. The step is replayed twice, the second
starting from the cache the first left (torchtitan logs the peak of a later step), with and without
`expandable_segments:True` (torchtitan's run_llama_train.sh at the benchmarked commit sets it).

    python benchmarks/reserved_estimate.py [--preset llama-3.1-8b] [--seq 32768] [--batch 1] [--checkpoint full]
        [--gpus 8] [--cp 1] [--layers N]
"""

from __future__ import annotations

import argparse
import time

from graphviz_core.analysis.allocator import replay
from graphviz_core.config import resolve_config
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.parallel.simulate import measure_step, workload_of
from graphviz_core.parallel.world import fake_world, simulation_lock

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--checkpoint", default="full", help="activation checkpointing: full, selective, none")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks (--seq is then the whole sequence)")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run (default: the preset's)")
    args = parser.parse_args()
    config = resolve_config(
        args.preset, dtype="float32", seq=args.seq, batch=args.batch, checkpoint=args.checkpoint, layers=args.layers
    )
    parallel = ParallelConfig("fsdp", args.gpus, mixed_precision="bf16-fp32-reduce", cp=args.cp)
    workload = workload_of(config)
    traces = []
    started = time.perf_counter()
    with simulation_lock(), fake_world(parallel) as meshes:
        result = measure_step(workload, parallel, meshes, config=config, on_allocations=traces.append)
    trace = traces[0]
    simulated_s = time.perf_counter() - started
    print(
        f"{args.preset}, {config.layers} layers, FSDP {args.gpus}, CP {args.cp}, seq {args.seq:,}, batch {args.batch}, "
        f"{config.checkpoint} AC, "
        "float32 master / bf16 compute / fp32 reduce, loss on float32 logits"
    )
    print(
        f"simulated in {simulated_s:.0f} s: {len(trace.events):,} allocations and frees on "
        f"{len(trace.streams)} streams ({', '.join(trace.streams.values())})"
    )
    print(f"simulation's peak (allocated, live tensors): {result.peak_bytes / GIB:7.2f} GiB")
    print(f"the trace's own peak:                        {trace.peak_bytes() / GIB:7.2f} GiB")
    for expandable in (True, False):
        label = "expandable_segments:True" if expandable else "default segments (expandable_segments:False)"
        first = replay(trace, expandable_segments=expandable)
        started = time.perf_counter()
        estimate = replay(trace.repeated(2), expandable_segments=expandable)
        lazy = replay(trace.deferred("optimizer state", "optimizer").repeated(2), expandable_segments=expandable)
        print(f"replay, {label} ({time.perf_counter() - started:.1f} s for two steps):")
        print(f"  peak allocated (blocks handed out):  {estimate.peak_allocated_bytes / GIB:7.2f} GiB")
        print(
            f"  ESTIMATED peak reserved, step 2:     {estimate.peak_reserved_bytes / GIB:7.2f} GiB "
            f"(step 1 from an empty cache: {first.peak_reserved_bytes / GIB:.2f} GiB)"
        )
        print(
            f"  the same with AdamW's state created by the first optimizer.step() (torch.optim's way): "
            f"{lazy.peak_reserved_bytes / GIB:.2f} GiB"
        )
        print(
            f"  reserved - allocated:                "
            f"{(estimate.peak_reserved_bytes - estimate.peak_allocated_bytes) / GIB:7.2f} GiB"
        )
        print(f"  reserved at the allocated peak:      {estimate.reserved_at_allocated_peak_bytes / GIB:7.2f} GiB")
        streams = ", ".join(
            f"{trace.streams.get(s, s)} {b / GIB:.2f} GiB" for s, b in estimate.peak_reserved_by_stream.items()
        )
        print(f"  segments at most: {estimate.peak_segments}; peak reserved by stream: {streams}")


if __name__ == "__main__":
    main()
