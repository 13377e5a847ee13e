"""What recording a training loop costs (issue 35): graphviz_core.record beside the tools people use today.

One transformers GPT-2 (random weights; gpt2-small by default: 12 layers, width 768, b=4, s=256) trains with AdamW
on the CPU. Each round runs every variant for `--steps` steps, the order rotating round by round so all see the same
machine load; a variant's figure is its median step time over the round (its first step, which pays one-time costs,
left out), and the table gives the median over rounds of its ratio to the bare loop's in the same round.

Variants: the bare loop; torch.profiler recording every step (`prof.step()`); torch.autograd.detect_anomaly; a
hand-written per-parameter gradient-norm logger (what Lightning's `grad_norm` does: one norm per parameter and the
total, read every step); the recorder with every figure; the recorder with parameters only (`nodes=False`).
Goals: the recorder <= 1.15x the bare loop, parameters only <= 1.03x. Also printed: the recording's bytes per step,
and the first recorded step's extra time (a new graph: its structure, saved bytes and FLOPs are read once).

    python benchmarks/bench_record.py [--steps 20] [--rounds 2] [--layers 12 --hidden 768 --batch 4 --seq 256]
    python benchmarks/bench_record.py --rss 1000     # RSS growth over 1,000 recorded steps of a 2-layer GPT-2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time

import torch

import graphviz_core

CPU_TIME = False  # --cpu-time: the process's CPU time (every thread) instead of wall time: steadier on a shared machine
VARIANTS = ("bare", "profiler", "anomaly", "norm logger", "recorder", "parameters only")


def model_and_batch(layers: int, hidden: int, batch: int, seq: int, vocab: int = 50257):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab_size=vocab,
                        n_positions=max(seq, 32), bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    return model, torch.randint(0, vocab, (batch, seq))


def run_variant(name: str, model, ids, steps: int, folder: str) -> list[float]:
    """`steps` training steps under the variant; each step's wall time."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    logged = []

    def step():
        model(ids, labels=ids).loss.backward()
        if name == "norm logger":
            norms = {n: torch.linalg.vector_norm(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            total = torch.linalg.vector_norm(torch.stack(list(norms.values())))
            logged.append({**{n: float(v) for n, v in norms.items()}, "total": float(total)})
        opt.step()
        opt.zero_grad()

    around = contextlib.nullcontext()
    if name == "profiler":
        around = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    elif name == "anomaly":
        around = torch.autograd.detect_anomaly(check_nan=True)
    elif name in ("recorder", "parameters only"):
        shutil.rmtree(folder, ignore_errors=True)
        around = graphviz_core.record(folder, model=model, nodes=name == "recorder")  # "parameters only": nodes=False
    times = []
    clock = time.process_time if CPU_TIME else time.perf_counter
    with around as context:
        for _ in range(steps):
            started = clock()
            step()
            if name == "profiler":
                context.step()
            times.append(clock() - started)
    return times


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def compare(args) -> None:
    model, ids = model_and_batch(args.layers, args.hidden, args.batch, args.seq)
    chosen = [v for v in VARIANTS if not args.only or v in args.only.split(",")]
    if "bare" not in chosen:
        chosen.insert(0, "bare")
    folder = tempfile.mkdtemp(prefix="bench-record-")
    ratios: dict[str, list[float]] = {v: [] for v in chosen}
    medians: dict[str, list[float]] = {v: [] for v in chosen}
    first_extra, per_step_bytes = [], []
    run_variant("bare", model, ids, 1, folder)  # the process's one-time costs, outside every round
    for round_ in range(args.rounds):
        order = chosen[round_ % len(chosen):] + chosen[: round_ % len(chosen)]
        this = {}
        for name in order:
            times = run_variant(name, model, ids, args.steps + 1, os.path.join(folder, name.replace(" ", "_")))
            this[name] = statistics.median(times[1:])
            if name == "recorder":
                first_extra.append(times[0] - this[name])
                path = os.path.join(folder, "recorder")
                per_step_bytes.append(folder_bytes(path) / (args.steps + 1))
            print(f"round {round_ + 1} {name}: median step {this[name]:.3f} s", flush=True)
        for name in chosen:
            medians[name].append(this[name])
            ratios[name].append(this[name] / this["bare"])
    shutil.rmtree(folder, ignore_errors=True)
    print(f"\nGPT-2 {args.layers} layers, width {args.hidden}, b={args.batch}, s={args.seq}, AdamW, CPU "
          f"({torch.get_num_threads()} threads; {'process CPU time' if CPU_TIME else 'wall time'}); {args.rounds} rounds x {args.steps} steps (+1 warm-up) per variant\n")
    print("| variant | median step | x bare loop |")
    print("| --- | --- | --- |")
    for name in chosen:
        print(f"| {name} | {statistics.median(medians[name]):.3f} s | {statistics.median(ratios[name]):.3f}x |")
    if per_step_bytes:
        print(f"\nrecording: {statistics.median(per_step_bytes) / 1e3:,.1f} kB per step (the graph stored once "
              f"included); first recorded step +{statistics.median(first_extra):.2f} s (a new graph read once)")


def rss_growth(steps: int) -> None:
    """RSS before and after `steps` recorded steps of a 2-layer GPT-2 (width 64, b=2, s=32)."""
    def rss() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

    model, ids = model_and_batch(2, 64, 2, 32, vocab=256)
    folder = tempfile.mkdtemp(prefix="bench-record-rss-")
    run_variant("bare", model, ids, 20, folder)
    before = rss()
    times = run_variant("recorder", model, ids, steps, os.path.join(folder, "run"))
    after = rss()
    print(f"{steps} recorded steps of a 2-layer GPT-2 (median {statistics.median(times) * 1e3:.1f} ms each): RSS "
          f"{before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB (+{(after - before) / 2**20:.1f} MiB); the recording "
          f"{folder_bytes(os.path.join(folder, 'run')) / 2**20:.1f} MiB")
    shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--only", help="comma-separated variants (the bare loop always runs): bare, profiler, anomaly, norm logger, recorder, parameters only")
    parser.add_argument("--rss", type=int, help="instead: RSS growth over this many recorded steps")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's choice)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the process's CPU time (all threads) instead of the wall clock: on a machine "
                             "other work shares, wall time measures the wait as much as the step")
    args = parser.parse_args()
    global CPU_TIME
    CPU_TIME = args.cpu_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss:
        rss_growth(args.rss)
    else:
        compare(args)


if __name__ == "__main__":
    main()
