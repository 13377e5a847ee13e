"""On a CUDA GPU: one model's training step run for real, beside what the simulation (fake tensors, no GPU) and the
allocator replay (graphviz_core.analysis.allocator) predict for it.

The simulation's peak is the bytes of live tensors (allocated memory); the replay's estimate is the caching
allocator's reserved memory. Here both meet the allocator's own counters, torch.cuda.max_memory_allocated() and
max_memory_reserved(), for the same config on one GPU (no parallelism: strategy none, AdamW, the parameters in --dtype):

- "warm": AdamW's state created before the first measured step (the simulation's and reserved_estimate.py's
  default: torchtitan logs a later step), then two steps, each peak read on its own;
- "lazy": no warm-up; the first step's optimizer.step() creates the state (torch.optim's way).

A third real step lists the attention and softmax kernels the GPU ran (the simulation runs on fake CPU tensors,
whose attention kernel may not be the GPU's).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/gpu_step_check.py [--preset llama-3.1-8b]
        [--layers 2] [--seq 4096] [--batch 1] [--checkpoint full] [--dtype float32] [--json out.json]

Prints one table per run mode; with --json, writes the figures. Needs a GPU for the real step (the simulation
and replay run anywhere: --no-real prints them alone).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphviz_core.analysis.allocator import replay
from graphviz_core.config import resolve_config
from graphviz_core.models.registry import build_model, compute_loss, make_batch
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.parallel.simulate import measure_step, workload_of
from graphviz_core.parallel.world import fake_world, simulation_lock

ATTENTION_OPS = ("attention", "softmax", "bmm", "baddbmm", "repeat_interleave")

GIB = 2**30


def predicted(config, expandable: bool) -> dict:
    """The simulation's allocated peak and the replay's reserved estimates for one step of `config`."""
    traces = []
    parallel = ParallelConfig()
    started = time.perf_counter()
    with simulation_lock(), fake_world(parallel) as meshes:
        result = measure_step(workload_of(config), parallel, meshes, config=config, on_allocations=traces.append)
    trace = traces[0]
    warm = replay(trace.repeated(2), expandable_segments=expandable)
    first = replay(trace, expandable_segments=expandable)
    lazy_trace = trace.deferred("optimizer state", "optimizer")
    lazy_first = replay(lazy_trace, expandable_segments=expandable)
    lazy = replay(lazy_trace.repeated(2), expandable_segments=expandable)
    return {
        "simulate_s": round(time.perf_counter() - started, 1),
        "simulated_peak_allocated": result.peak_bytes,
        "trace_peak": trace.peak_bytes(),
        "warm_step1_allocated": first.peak_allocated_bytes,
        "warm_step1_reserved": first.peak_reserved_bytes,
        "warm_step2_allocated": warm.peak_allocated_bytes,
        "warm_step2_reserved": warm.peak_reserved_bytes,
        "lazy_step1_reserved": lazy_first.peak_reserved_bytes,
        "lazy_step2_reserved": lazy.peak_reserved_bytes,
    }


def _step(config, model, optimizer, batch) -> None:
    out = model(batch.inputs)
    loss = compute_loss(config, out, batch.targets)
    del out
    loss.backward()
    del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class OpCensus(TorchDispatchMode):
    """How often each op whose name holds one of `parts` ran (ATTENTION_OPS: attention, softmax, batched matmul)."""

    def __init__(self, parts: tuple[str, ...] = ATTENTION_OPS):
        super().__init__()
        self.parts = parts
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if any(part in name for part in self.parts):
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))

    def counts(self) -> dict[str, int]:
        return dict(sorted(self.seen.items()))


class HighWater(TorchDispatchMode):
    """Op by op on the GPU: the allocator's bytes before each aten op, its peak while the op ran (the peak counter reset
    before each) and after, less the bytes allocated on entering; an op's own temporaries (which a fake-tensor
    simulation does not see) are `held_inside`."""

    def __init__(self):
        super().__init__()
        self.base = torch.cuda.memory_allocated()
        self.rows: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        self.rows.append(
            {
                "op": str(func.overloadpacket.__name__),
                "before": before - self.base,
                "peak": torch.cuda.max_memory_allocated() - self.base,
                "after": torch.cuda.memory_allocated() - self.base,
            }
        )
        return out


def held_inside(row: dict) -> int:
    """The bytes one op held beyond its inputs and output (a HighWater row)."""
    return row["peak"] - max(row["before"], row["after"])


def _attention_ops(config, model, optimizer, batch) -> dict[str, int]:
    """How often each attention-, softmax- or batched-matmul op ran in one more step."""
    with OpCensus() as census:
        _step(config, model, optimizer, batch)
    return census.counts()


def _op_high_water(config, model, optimizer, batch) -> list[dict]:
    """One more step, op by op (HighWater's rows)."""
    with HighWater() as water:
        _step(config, model, optimizer, batch)
    return water.rows


def _print_high_water(rows: list[dict], around: int = 6) -> None:
    """The ops around the step's highest in-op peak, with the bytes each held beyond its inputs and outputs."""
    top = max(range(len(rows)), key=lambda i: rows[i]["peak"])
    print(f"op-by-op high water: {len(rows)} ops; the peak in op {top} ({rows[top]['op']})")
    for i in range(max(0, top - around), min(len(rows), top + around + 1)):
        r = rows[i]
        print(
            f"  {i:5d} {r['op']:42s} before {r['before'] / GIB:8.3f}  peak {r['peak'] / GIB:8.3f}  "
            f"after {r['after'] / GIB:8.3f} GiB  held inside {held_inside(r) / 2**20:9.1f} MiB"
        )
    print("  the ops holding most inside themselves:")
    for r in sorted(rows, key=held_inside, reverse=True)[:8]:
        print(f"    {r['op']:42s} {held_inside(r) / 2**20:9.1f} MiB at {r['peak'] / GIB:.3f} GiB")


def measured(config, warm: bool) -> dict:
    """The allocator's peaks for two real steps on the GPU, each from a peak reset just before it."""
    device = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with device:
        model = build_model(config.replace(device="cuda"))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_batch(config, device)
    if warm:  # as the simulation's _warm_optimizer_state: zero gradients, one step, gradients dropped
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()  # the replay starts from parameters, state and batch only: no cached gradient blocks
    out = {"before_step_allocated": torch.cuda.memory_allocated() - base}
    for step in (1, 2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        _step(config, model, optimizer, batch)
        torch.cuda.synchronize()
        out[f"step{step}_s"] = round(time.perf_counter() - started, 3)
        out[f"step{step}_allocated"] = torch.cuda.max_memory_allocated() - base
        out[f"step{step}_reserved"] = torch.cuda.max_memory_reserved()
    if warm:
        out["attention_ops"] = _attention_ops(config, model, optimizer, batch)
        out["op_high_water"] = _op_high_water(config, model, optimizer, batch)
    del model, optimizer, batch
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--checkpoint", default="full")
    parser.add_argument("--dtype", default="float32", help="the parameters' dtype: float32 or bfloat16")
    parser.add_argument("--no-real", action="store_true", help="the predictions only (no GPU needed)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    config = resolve_config(
        args.preset, dtype=args.dtype, seq=args.seq, batch=args.batch, checkpoint=args.checkpoint, layers=args.layers
    )
    expandable = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    figures = {
        "config": f"{args.preset}, {config.layers} layers, seq {args.seq}, batch {args.batch}, "
        f"{config.checkpoint} checkpointing, {config.dtype}, AdamW, one device",
        "expandable_segments": expandable,
        "torch": torch.__version__,
        "predicted": predicted(config, expandable),
    }
    if not args.no_real:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --no-real for the predictions alone")
        figures["device"] = torch.cuda.get_device_name()
        figures["warm"] = measured(config, warm=True)
        figures["lazy"] = measured(config, warm=False)
    p = figures["predicted"]
    print(figures["config"], "| expandable_segments:", expandable, "| torch", torch.__version__)
    rows = [("simulated peak allocated (one step)", p["simulated_peak_allocated"], "warm", "step2_allocated")]
    rows += [
        ("replay allocated, warm step 1", p["warm_step1_allocated"], "warm", "step1_allocated"),
        ("replay reserved, warm step 1", p["warm_step1_reserved"], "warm", "step1_reserved"),
        ("replay allocated, warm step 2", p["warm_step2_allocated"], "warm", "step2_allocated"),
        ("replay reserved, warm step 2", p["warm_step2_reserved"], "warm", "step2_reserved"),
        ("replay reserved, lazy step 1", p["lazy_step1_reserved"], "lazy", "step1_reserved"),
        ("replay reserved, lazy step 2", p["lazy_step2_reserved"], "lazy", "step2_reserved"),
    ]
    for label, guess, mode, key in rows:
        real = figures.get(mode, {}).get(key)
        tail = f"  measured {real / GIB:8.3f} GiB  ({(guess - real) / real:+.1%})" if real else ""
        print(f"{label:38s} {guess / GIB:8.3f} GiB{tail}")
    if "warm" in figures:
        print("attention-related ops in one real step:", figures["warm"]["attention_ops"])
        _print_high_water(figures["warm"]["op_high_water"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
