"""Capture overhead: a full instrumented capture vs a bare forward + backward of the same model.

Config from issue 2: gpt2, 4 layers, h=512, 8 heads, b=8, s=256 (GPT-2's vocab), CPU. Runs alternate in one
process so both see the same machine load; prints the ratio of medians and of the best runs (the best
run is the least disturbed by other work on a shared machine). Goal: <= 1.3x.

    python benchmarks/bench_capture.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from graphviz_core.capture import capture_backward
from graphviz_core.config import ModelConfig
from graphviz_core.models import build_model, compute_loss, make_batch

CONFIG = ModelConfig(model="gpt2", layers=4, hidden=512, heads=8, vocab=50257, batch=8, seq=256, device="cpu")


def bare_step(config: ModelConfig) -> float:
    """Build, forward, loss, backward: exactly what the capture does, with no instrumentation. Both steps
    include freeing what they allocated, so neither leaves its clean-up to the other's timing."""
    started = time.perf_counter()
    model = build_model(config)
    batch = make_batch(config, "cpu")
    compute_loss(config, model(batch.inputs), batch.targets).backward()
    del model, batch
    return time.perf_counter() - started


def captured_step(config: ModelConfig) -> float:
    started = time.perf_counter()
    capture = capture_backward(config)
    del capture
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"config: {CONFIG}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    bare_step(CONFIG)  # warm-up: allocator, kernels, lazy imports
    captured_step(CONFIG)
    bare, captured = [], []
    for _ in range(args.repeats):
        bare.append(bare_step(CONFIG))
        captured.append(captured_step(CONFIG))
    capture = capture_backward(CONFIG)
    b, c = statistics.median(bare), statistics.median(captured)
    print(f"nodes: {capture.summary.nodes}, backward FLOPs: {capture.flops.backward:,}")
    print(f"bare forward+backward: median {b:.3f} s  {[round(x, 3) for x in bare]}")
    print(f"full capture:          median {c:.3f} s  {[round(x, 3) for x in captured]}")
    print(f"ratio capture/bare: median {c / b:.3f}x, best-of-{args.repeats} {min(captured) / min(bare):.3f}x (goal <= 1.3x)")


if __name__ == "__main__":
    main()
