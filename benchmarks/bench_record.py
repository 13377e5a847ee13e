"""What recording a training loop costs (issue 35): graphviz_core.record beside the tools people use today.

One transformers GPT-2 (random weights; gpt2-small by default: 12 layers, width 768, b=4, s=256) trains with AdamW
on the CPU. Each round runs every variant for `--steps` steps, the order rotating round by round so all see the same
machine load; a variant's figure is its median step time over the round (its first step, which pays one-time costs,
left out), and the table gives the median over rounds of its ratio to the bare loop's in the same round.

Variants: the bare loop; torch.profiler recording every step (`prof.step()`); torch.autograd.detect_anomaly; a
hand-written per-parameter gradient-norm logger (what Lightning's `grad_norm` does: one norm per parameter and the
total, read every step); the recorder with every figure (the backward's gradient-flow check included); the recorder
with parameters only (`nodes=False`); the recorder with the forward check (`check_forward=True`).
Goals: the recorder <= 1.15x the bare loop, parameters only <= 1.03x (issue 36: the backward check <= 1.2x, the
forward check's cost printed beside detect_anomaly's). Also printed: the recording's bytes per step,
and the first recorded step's extra time (a new graph: its structure, saved bytes and FLOPs are read once).

    python benchmarks/bench_record.py [--steps 20] [--rounds 2] [--layers 12 --hidden 768 --batch 4 --seq 256]
    python benchmarks/bench_record.py --rss 1000     # RSS growth over 1,000 recorded steps of a 2-layer GPT-2
    python benchmarks/bench_record.py --disk 100     # the recording's size after 100 steps of gpt2-small
    python benchmarks/bench_record.py --own 3 [--parameters-only]   # the recorder's own CPU time per step
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
# --user-time: the process's user CPU time only. On this machine a gpt2-small step takes 430,000-1,000,000 minor page
# faults (the allocator maps its large activations afresh every step and the kernel zeroes ~2 GB of pages), 0.7-1.6 s
# of system time that swings from step to step by more than the 1-3% being measured; the recorder's own work (norms,
# the weights' copy, the write) is user time, and it adds no page faults (measured: 428,507-556,230 per recorded step,
# 432,377-605,798 per bare one)
USER_TIME = False
VARIANTS = ("bare", "profiler", "anomaly", "norm logger", "recorder", "parameters only", "forward check")


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
    elif name in ("recorder", "parameters only", "forward check"):
        shutil.rmtree(folder, ignore_errors=True)
        # "recorder": every figure and the backward's gradient-flow check (docs/debugging.md); "parameters only":
        # nodes=False; "forward check": the recorder with check_forward=True (every op of the forward checked)
        around = graphviz_core.record(folder, model=model, nodes=name != "parameters only",
                                      check_forward=name == "forward check")
    times = []
    clock = _user_time if USER_TIME else time.process_time if CPU_TIME else time.perf_counter
    with around as context:
        for _ in range(steps):
            started = clock()
            step()
            if name == "profiler":
                context.step()
            times.append(clock() - started)
    return times


def _user_time() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


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
          f"({torch.get_num_threads()} threads; {'process user CPU time' if USER_TIME else 'process CPU time' if CPU_TIME else 'wall time'}); {args.rounds} rounds x {args.steps} steps (+1 warm-up) per variant\n")
    print("| variant | median step | x bare loop |")
    print("| --- | --- | --- |")
    for name in chosen:
        print(f"| {name} | {statistics.median(medians[name]):.3f} s | {statistics.median(ratios[name]):.3f}x |")
    if per_step_bytes:
        print(f"\nrecording: {statistics.median(per_step_bytes) / 1e3:,.1f} kB per step (the graph stored once "
              f"included); first recorded step +{statistics.median(first_extra):.2f} s (a new graph read once)")


def rss_growth(steps: int) -> None:
    """RSS before recording, after its first 20 steps (one-time costs: pyarrow's import, the first graph, the
    optimizer's state) and after `steps` recorded steps of a 2-layer GPT-2 (width 64, b=2, s=32)."""
    def rss() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

    model, ids = model_and_batch(2, 64, 2, 32, vocab=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    folder = tempfile.mkdtemp(prefix="bench-record-rss-")

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(20):
        step()
    before = rss()
    started = time.perf_counter()
    with graphviz_core.record(os.path.join(folder, "run"), model=model):
        for _ in range(20):
            step()
        warmed = rss()
        for _ in range(steps - 20):
            step()
        after = rss()
    each = (time.perf_counter() - started) / steps
    mib = 2 ** 20
    print(f"{steps} recorded steps of a 2-layer GPT-2 ({each * 1e3:.1f} ms each): RSS {before / mib:.1f} MiB before, "
          f"{warmed / mib:.1f} MiB after 20 steps (+{(warmed - before) / mib:.1f}: one-time), {after / mib:.1f} MiB after "
          f"{steps} (+{(after - warmed) / mib:.1f} over the last {steps - 20}); the recording "
          f"{folder_bytes(os.path.join(folder, 'run')) / mib:.1f} MiB")
    shutil.rmtree(folder, ignore_errors=True)


def disk_size(steps: int) -> None:
    """The recording's size after `steps` steps of gpt2-small (12 layers, width 768): its graph, and so its rows per
    step, do not depend on the batch, so a batch of 1 x 16 tokens measures what b=4, s=256 writes, quickly."""
    model, ids = model_and_batch(12, 768, 1, 16)
    folder = tempfile.mkdtemp(prefix="bench-record-disk-")
    run_variant("recorder", model, ids, steps, os.path.join(folder, "run"))
    total = folder_bytes(os.path.join(folder, "run"))
    graphs = folder_bytes(os.path.join(folder, "run", "graphs"))
    print(f"{steps} recorded steps of gpt2-small: {total / 1e6:.2f} MB on disk ({graphs / 1e6:.2f} MB of it the graph, "
          f"stored once; {(total - graphs) / steps / 1e3:.1f} kB per step)")
    shutil.rmtree(folder, ignore_errors=True)


def own_time(steps: int, args) -> None:
    """The recorder's own CPU time per step, summed inside its functions (the graph walk and hook registration, the
    node hooks, the gradient figures, the optimizer-step hooks and the write, and the gradient-flow watch of
    capture.nonfinite that a recording with nodes runs): far steadier than a difference of two
    step times on a machine other work shares."""
    from graphviz_core.capture import record_hooks, recorder

    spent = [0.0]

    def timed(function):
        def wrapper(*a, **k):
            started = time.thread_time()
            try:
                return function(*a, **k)
            finally:
                spent[0] += time.thread_time() - started

        return wrapper

    def timed_factory(factory):  # BackwardProbe's _pre/_post return the hook: time the hook
        return lambda self, i: timed(factory(self, i))

    from graphviz_core.capture.nonfinite import DebugWatch  # the gradient-flow watch every node recording runs

    probe, rec = record_hooks.BackwardProbe, recorder.Recorder
    originals = {(probe, "__init__"): probe.__init__, (probe, "figures"): probe.figures, (probe, "remove"): probe.remove,
                 (probe, "_pre"): probe._pre, (probe, "_post"): probe._post,
                 (rec, "_before_step"): rec._before_step, (rec, "_after_step"): rec._after_step,
                 **{(DebugWatch, name): getattr(DebugWatch, name) for name in ("_pre", "_post", "backward", "end_step")}}
    for (owner, name), function in originals.items():
        factory = owner is probe and name in ("_pre", "_post")
        setattr(owner, name, timed_factory(function) if factory else timed(function))
    model, ids = model_and_batch(args.layers, args.hidden, args.batch, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    bare = []
    for _ in range(steps + 1):
        started = time.thread_time()
        step()
        bare.append(time.thread_time() - started)
    folder = tempfile.mkdtemp(prefix="bench-record-own-")
    own, whole = [], []
    with graphviz_core.record(os.path.join(folder, "run"), model=model, nodes=not args.parameters_only):
        for _ in range(steps + 1):
            spent[0] = 0.0
            started = time.thread_time()
            step()
            whole.append(time.thread_time() - started)
            own.append(spent[0])
    for (owner, name), function in originals.items():
        setattr(owner, name, function)
    shutil.rmtree(folder, ignore_errors=True)
    base = statistics.median(bare[1:])
    mine = statistics.median(own[1:])  # the first recorded step reads a new graph: left out, as the warm-up is
    what = "parameters only" if args.parameters_only else "every figure"
    print(f"GPT-2 {args.layers} layers, width {args.hidden}, b={args.batch}, s={args.seq}, AdamW, "
          f"{torch.get_num_threads()} thread(s): bare step {base:.3f} s (median of {steps}); the recorder ({what}) "
          f"spent {mine:.3f} s of its own per step = {mine / base:.3f} of the bare step -> {1 + mine / base:.3f}x; "
          f"first recorded step: {own[0]:.3f} s of its own; the recorded step took {statistics.median(whole[1:]):.3f} s "
          f"(x{statistics.median(whole[1:]) / base:.3f} the bare step's, run after it: a difference of two step times)")


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
    parser.add_argument("--disk", type=int, help="instead: the recording's size after this many gpt2-small steps")
    parser.add_argument("--own", type=int, help="instead: the recorder's own CPU time per step over this many steps")
    parser.add_argument("--parameters-only", action="store_true", help="with --own: record parameters only")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's choice)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the process's CPU time (all threads) instead of the wall clock: on a machine "
                             "other work shares, wall time measures the wait as much as the step")
    parser.add_argument("--user-time", action="store_true",
                        help="time by the process's user CPU time (all threads): without the system time of the "
                             "page faults the loop's own allocations take, which swing by more than the recorder costs")
    args = parser.parse_args()
    global CPU_TIME, USER_TIME
    CPU_TIME, USER_TIME = args.cpu_time, args.user_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss:
        rss_growth(args.rss)
    elif args.disk:
        disk_size(args.disk)
    elif args.own:
        own_time(args.own, args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
