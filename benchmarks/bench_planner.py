"""The planner on Llama-3.1-70B over 64 H100s of 80 GiB, seq 8192, global batch 256: time and layouts planned, and
three of its layouts each against a full simulation of that layout (every layer, every pipeline rank).

Goal (issue 24): >= 24 layouts simulated in <= 60 s on this 2-core machine. The planner simulates each layout on
3 and 4 layers per pipeline stage and scales (graphviz_core.parallel.planner); the full simulations here run all 80.
Wall time depends on what else the machine runs: the load average and the CPU seconds (this process and its
workers) are printed beside it.

    python benchmarks/bench_planner.py [--jobs 2] [--skip-full]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

from graphviz_core.config import config_from_preset
from graphviz_core.parallel.pipeline import simulate_layout
from graphviz_core.parallel.planner import Cluster, plan

GOAL_LAYOUTS = 24
GOAL_S = 60.0
COMMAND = ("graphviz-core plan --preset llama-3.1-70b --gpus 64 --gpu-memory 80GiB --seq 8192 --global-batch 256 "
           "--format table")


def _cpu_s() -> float:
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def _full(config, layout) -> tuple[int, int]:
    """The busiest rank's peak and the bytes it sends per optimizer step, from the simulator's own PerRank."""
    result = simulate_layout(layout.model(config), layout.parallel(), single_device=False)
    ranks = list(result.pipeline.ranks) if result.pipeline else [result]
    sent = max(sum(c.traffic_bytes for c in r.collectives if c.kind not in ("send", "recv")) for r in ranks)
    return max(r.peak_bytes for r in ranks), sent * layout.accumulation


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--skip-full", action="store_true", help="time the plan only")
    args = parser.parse_args()
    config = config_from_preset("llama-3.1-70b", seq=8192)
    cluster = Cluster(gpus=64, gpu_memory_bytes=80 * 2**30)
    print(f"{config.describe()}; 64 GPUs of 80 GiB, 8 per node; same as: {COMMAND}")
    load = os.getloadavg()[0]
    cpu, started = _cpu_s(), time.perf_counter()
    reached: dict[int, float] = {}  # layouts done -> wall s when the count was reached (the workers' CPU time is
    # known only once they exit)

    def progress(done: int, total: int, what: str) -> None:
        reached.setdefault(done, time.perf_counter() - started)
        print(f"  [{done}/{total}] {what}", file=sys.stderr)

    result = plan(config, cluster, 256, checkpoints=("none", "selective-ops", "full"), microbatch_sizes=(1, 2),
                  pp_degrees=(1, 2), cp_degrees=(1, 2), jobs=args.jobs, progress=progress)
    took, cpu = time.perf_counter() - started, _cpu_s() - cpu
    simulated, skipped = len(result.planned), len(result.skipped)
    print(f"{simulated} layouts simulated and ranked, {skipped} settled or refused without a run "
          f"({simulated + skipped} enumerated); load average {load:.1f} on {os.cpu_count()} cores at the start")
    print(f"{'what':<40}{'measured':>12}{'goal':>10}{'ratio':>8}")
    print(f"{'layouts simulated':<40}{simulated:>12}{GOAL_LAYOUTS:>10}{simulated / GOAL_LAYOUTS:>8.2f}")
    print(f"{'plan, wall time':<40}{took:>11.1f}s{GOAL_S:>9.0f}s{took / GOAL_S:>8.2f}")
    print(f"{'plan, CPU time (all processes)':<40}{cpu:>11.1f}s{2 * GOAL_S:>9.0f}s{cpu / (2 * GOAL_S):>8.2f}"
          "   (2 cores x the goal)")
    if GOAL_LAYOUTS in reached:
        wall = reached[GOAL_LAYOUTS]
        print(f"{f'first {GOAL_LAYOUTS} layouts, wall time':<40}{wall:>11.1f}s{GOAL_S:>9.0f}s{wall / GOAL_S:>8.2f}")
    for p in result.planned[:5]:
        print(f"  {p.layout.label():<40} peak {p.peak_bytes / 2**30:6.1f} GiB  fits {p.fits!s:<5} "
              f"{p.tokens_per_s_per_gpu:8,.0f} tokens/s/GPU (estimate)")
    if args.skip_full:
        return
    by_mesh = {(tuple(p.layout.mesh().values()), p.layout.checkpoint, p.layout.microbatch_size): p
               for p in result.planned}
    chosen = [by_mesh.get(key) for key in (((64, 1, 1, 1, 1), "full", 1), ((32, 1, 1, 1, 2), "full", 1),
                                           ((8, 1, 4, 2, 1), "full", 1))]
    print(f"{'layout (full simulation of 80 layers)':<40}{'planner peak':>16}{'full peak':>16}"
          f"{'planner sent':>18}{'full sent':>18}{'equal':>7}{'full s':>8}")
    for planned in filter(None, chosen):
        started = time.perf_counter()
        peak, sent = _full(config, planned.layout)
        equal = peak == planned.peak_bytes and sent == planned.collective_bytes_per_step
        print(f"{planned.layout.label():<40}{planned.peak_bytes:>16,}{peak:>16,}{planned.collective_bytes_per_step:>18,}"
              f"{sent:>18,}{'yes' if equal else 'NO':>7}{time.perf_counter() - started:>8.0f}")


if __name__ == "__main__":
    main()
