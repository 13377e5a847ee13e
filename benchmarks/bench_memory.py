"""Memory panel speed: the timeline's cost on gpt2-small (CPU), the three-way checkpoint comparison of the
largest presets on meta, and a will-it-fit search. Prints each figure next to its goal (issue 8).

- timeline: a capture (timeline included) vs a bare build + forward + backward of the same model, runs
  alternating in one process; and the same capture with the storage observer switched off, so the
  observer's own share is visible. Goal: capture with timeline <= 1.3x bare.
- checkpoint comparison (none / full / selective) on meta. Goal: <= 30 s.
- will-it-fit (largest batch and seq for every policy). Goal: <= 60 s.

    python benchmarks/bench_memory.py [--repeats N] [--skip-timeline]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from readme_rows import row
from steps import bare_step, captured_step

from graphviz_core.analysis.checkpointing import compare_checkpointing
from graphviz_core.analysis.fit import will_it_fit
from graphviz_core.analysis.training_step import ACCELERATORS
from graphviz_core.capture.engine import INSTRUMENTS
from graphviz_core.config import config_from_preset
from graphviz_core.ui.format import format_bytes


def bench_timeline(repeats: int) -> None:
    config = config_from_preset("gpt2-small", device="cpu")
    print(
        f"timeline: gpt2-small on CPU, b={config.batch} s={config.seq}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    bare_step(config)
    captured_step(config)
    bare, captured, without = [], [], []
    for _ in range(repeats):
        bare.append(bare_step(config))
        captured.append(captured_step(config))
        without.append(captured_step(config, instruments=[name for name in INSTRUMENTS if name != "timeline"]))
    for name, runs in (
        ("bare build + fwd + bwd", bare),
        ("capture with timeline", captured),
        ("capture, observer off", without),
    ):
        print(f"  {name:24s} median {statistics.median(runs):.2f} s  best {min(runs):.2f} s")
    ratio = statistics.median(captured) / statistics.median(bare)
    print(f"  capture with timeline / bare: median {ratio:.2f}x, best {min(captured) / min(bare):.2f}x  (goal <= 1.3x)")
    row("gpt2-small on CPU: capture with memory timeline vs bare (`bench_memory.py`)",
        f"{ratio:.2f}x (median of {repeats})", "<= 1.3x")
    share = statistics.median(captured) / statistics.median(without)
    print(f"  timeline observer alone: {share:.2f}x the capture without it")


def bench_checkpoints(preset: str) -> None:
    config = config_from_preset(preset)
    started = time.perf_counter()
    table = compare_checkpointing(config)
    took = time.perf_counter() - started
    print(f"checkpoint comparison, {preset} on meta: {took:.1f} s  (goal <= 30 s)")
    row(f"none / full / selective checkpointing side by side, {preset} on meta", f"{took:.1f} s", "<= 30 s")
    for r in table.rows:
        print(
            f"  {r.policy:9s} saved {format_bytes(r.saved_bytes):>10s}  held {format_bytes(r.held_bytes):>10s}  "
            f"activation peak {format_bytes(r.activation_peak_bytes):>10s}  step peak {format_bytes(r.step_peak_bytes):>10s}"
            f"  recompute {r.recompute_over_forward:.0%} of a forward"
        )


def bench_fit(preset: str, budget_bytes: int, label: str) -> None:
    config = config_from_preset(preset)
    started = time.perf_counter()
    search = will_it_fit(config, budget_bytes)
    took = time.perf_counter() - started
    captures = sum(r.captures for r in search.results)
    print(
        f"will-it-fit, {preset}, budget {label} ({format_bytes(budget_bytes)}): {took:.1f} s, {captures} meta "
        f"captures  (goal <= 60 s)"
    )
    row(f"will it fit, {preset} in {label}", f"{took:.1f} s ({captures} meta captures)", "<= 60 s")
    for r in search.results:
        print(
            f"  {r.policy:9s} largest {r.dimension:5s} {r.largest:>9,}  closed form "
            f"{'—' if r.predicted_largest is None else f'{r.predicted_largest:,}':>9s}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-timeline", action="store_true")
    args = parser.parse_args()
    if not args.skip_timeline:
        bench_timeline(args.repeats)
    bench_checkpoints("llama-3.1-70b")
    bench_checkpoints("llama-3.1-405b")
    bench_fit("llama-3.1-70b", ACCELERATORS["141 GB (H200)"], "one H200")
    bench_fit("llama-3.1-70b", 2 * 2**40, "2 TiB")
    bench_fit("gpt2-small", ACCELERATORS["24 GB (RTX 4090)"], "one RTX 4090")


if __name__ == "__main__":
    main()
