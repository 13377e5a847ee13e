"""What recording costs on a CUDA GPU (issue 35's benchmark, the GPU's column; benchmarks/bench_record.py is the CPU's).

One transformers GPT-2 (random weights; gpt2-small: 12 layers, width 768, b=4, s=256, or as given) trains with AdamW
on the GPU. Each round runs every variant for `--steps` steps, the order rotating round by round; a step's time is
taken with the GPU synchronised at both ends; a variant's figure is its mean step time (the first step left out),
and the table gives the median over rounds of its ratio to the bare loop's in the same round; then each recording's
peak beside the bare loop's, read from the allocator by hand.

    python benchmarks/gpu_record_bench.py [--steps 21] [--rounds 3] [--layers 12 --hidden 768 --batch 4 --seq 256]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time

import torch
from bench_record import model_and_batch  # the CPU benchmark's model and batch (benchmarks/ is on the path)

import graphviz_core
from graphviz_core.graph.recording import open_recording

VARIANTS = ("bare", "anomaly", "recorder", "nodes every 10th step", "parameters only", "recorder + forward check")


def run_variant(name: str, model, ids, steps: int, folder: str) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    around = contextlib.nullcontext()
    if name == "anomaly":
        around = torch.autograd.detect_anomaly(check_nan=True)
    elif name != "bare":
        shutil.rmtree(folder, ignore_errors=True)
        around = graphviz_core.record(folder, model=model, nodes=name != "parameters only",
                                      check_forward=name == "recorder + forward check",
                                      nodes_every=10 if name == "nodes every 10th step" else 1)
    times = []
    with around:
        for _ in range(steps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    model, ids = model_and_batch(args.layers, args.hidden, args.batch, args.seq)
    model, ids = model.cuda(), ids.cuda()
    folder = tempfile.mkdtemp()
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        # the mean step after the first: a variant with node figures on every 10th step pays them on 1 step in 10
        got = {v: statistics.mean(run_variant(v, model, ids, args.steps, f"{folder}/{v}")[1:]) for v in order}
        for v in VARIANTS:
            ratios[v].append(got[v] / got["bare"])
            medians[v].append(got[v])
    print(f"{torch.cuda.get_device_name()}: GPT-2 {args.layers} layers, width {args.hidden}, b={args.batch}, "
          f"s={args.seq}, {args.steps} steps x {args.rounds} rounds")
    print(f"{'variant':<28}{'mean step (ms)':>18}{'x bare (median of rounds)':>28}")
    for v in VARIANTS:
        print(f"{v:<28}{1e3 * statistics.median(medians[v]):>18.1f}{statistics.median(ratios[v]):>28.3f}")
    # the recorded peak (the caching allocator's, the recorder's own copy of the parameters left out) beside the
    # bare loop's, read by hand from the allocator: the difference is what the per-node figures add in backward
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    bare_peaks = []
    for _ in range(4):  # from the third step on the optimizer's state exists, as in the recorded steps compared
        torch.cuda.reset_peak_memory_stats()
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        bare_peaks.append(torch.cuda.max_memory_allocated())
    del opt
    bare = max(bare_peaks[2:])
    for v in ("parameters only", "nodes every 10th step", "recorder", "recorder + forward check"):
        recorded = max(s.peak_bytes for s in open_recording(f"{folder}/{v}").steps()[2:])
        print(f"peak bytes, {v}: recorded {recorded:,}; bare loop {bare:,} by hand; "
              f"{(recorded - bare) / 2**20:+.1f} MiB")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
