"""Capture overhead against its peers: PyTorch's own profiler and MemTracker around the same forward + backward.

Variants, each timed on a model built for it outside the timing (build excluded for every variant):

- bare: forward, loss and backward, nothing else;
- profiler: the same inside `torch.profiler.profile(activities=[CPU])` (enter to exit); the parsing of its events
  (`prof.events()`, lazy since torch 2.x) is timed apart and reported beside it, with its count of autograd-node
  events (`autograd::engine::evaluate_function: ...`) against our graph's nodes;
- memtracker: the same inside `torch.distributed._tools.mem_tracker.MemTracker` (`track_external(model)` included
  in the timing), its peak reported next to ours;
- capture: `graphviz_core.capture_backward(config)` end to end (admission, hooks, forward, graph walk, backward,
  annotation, the Capture, freeing the model and returning memory to the OS) minus the model build, which it does
  inside: the build is excluded by subtracting this round's median of the timed `build_model(config)` +
  `make_batch(config)` that the other variants run outside their timing (no monkeypatching);
- graph-only: the same with `instruments=` asking for the graph alone (nodes, edges, categories, modules), where
  `capture_backward` takes that keyword (checked with `inspect.signature`): the engine's `GRAPH_ONLY` set where it
  has one (else `--instruments`); build subtracted the same way.

Paired rounds: each round runs every variant once, the order rotating round by round, so they share the machine's
load; the figures are the medians of the per-round ratios to the round's bare step. One untimed round first pays
the process's one-time costs (the capture's warm-up captures, the profiler's start, lazy imports). Every variant starts
on a trimmed heap, as a capture leaves it (`fresh_heap`). Ratios are given in wall clock and in the main thread's CPU
time, which a loaded machine moves far less.

    python benchmarks/bench_peers.py [--preset gpt2-small] [--batch 4] [--seq 256] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import importlib
import inspect
import os
import statistics
import time
from collections.abc import Callable

import torch
from readme_rows import row
from torch.distributed._tools.mem_tracker import MemTracker
from torch.profiler import ProfilerActivity, profile

import graphviz_core
from graphviz_core.config import ModelConfig, config_from_preset
from graphviz_core.models.registry import build_model, compute_loss, make_batch

NODE_EVENT = "autograd::engine::evaluate_function: "
MiB = 2**20


def _malloc_trim():
    try:
        trim = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
    except OSError:
        return None
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim


MALLOC_TRIM = _malloc_trim()  # glibc only


def fresh_heap() -> None:
    """Untimed, before every variant: collect garbage and hand freed heap pages back to the OS (malloc_trim(0)), as
    every capture does when it ends (graphviz_core.capture.admission.return_freed_memory). Without it the variant
    that follows a capture in the rotation would start on a trimmed heap and fault its pages back in (~150,000
    page faults, ~0.3 s of system time for gpt2-small b=4 s=256), the others on a warm one."""
    gc.collect()
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


def now() -> tuple[float, float]:
    """Wall clock and this (the main) thread's CPU time. The CPU time leaves out the time the process waited for a
    core, so it moves far less than the wall clock when other work loads the machine; it also leaves out the
    intra-op worker threads' share of the kernels."""
    return time.perf_counter(), time.thread_time()


class Round:
    """What one round measured: wall and main-thread CPU seconds per variant, the builds timed outside the
    variants, and extras."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.builds: list[tuple[float, float]] = []
        self.extra: dict[str, object] = {}

    def record(self, name: str, started: tuple[float, float]) -> None:
        wall, cpu = now()
        self.seconds[name] = wall - started[0]
        self.cpu[name] = cpu - started[1]

    def build(self, config: ModelConfig) -> tuple[torch.nn.Module, object]:
        """A fresh model and batch for one variant, outside its timing; the seconds are kept for the capture's
        build subtraction."""
        fresh_heap()
        started = now()
        model = build_model(config)
        batch = make_batch(config, "cpu")
        wall, cpu = now()
        self.builds.append((wall - started[0], cpu - started[1]))
        return model, batch


def bare(config: ModelConfig, r: Round) -> None:
    model, batch = r.build(config)
    started = now()
    compute_loss(config, model(batch.inputs), batch.targets).backward()
    r.record("bare", started)
    del model, batch


def profiler(config: ModelConfig, r: Round) -> None:
    model, batch = r.build(config)
    started = now()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compute_loss(config, model(batch.inputs), batch.targets).backward()
    r.record("profiler", started)
    started = time.perf_counter()
    events = prof.events()
    r.extra["profiler parse s"] = time.perf_counter() - started
    r.extra["profiler events"] = len(events)
    r.extra["profiler node events"] = sum(1 for e in events if e.name.startswith(NODE_EVENT))
    del model, batch, prof, events


def memtracker(config: ModelConfig, r: Round) -> None:
    model, batch = r.build(config)
    started = now()
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        compute_loss(config, model(batch.inputs), batch.targets).backward()
    r.record("memtracker", started)
    peak = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
    r.extra["memtracker peak"] = peak.get("Total", 0)
    r.extra["memtracker by kind"] = {str(getattr(k, "value", k)): v for k, v in peak.items() if k != "Total" and v}
    del model, batch, tracker


def capture(config: ModelConfig, r: Round) -> None:
    # Every instrument of the forward + backward; not the optimizer's step after it, which bare and the peers never run.
    engine = importlib.import_module(graphviz_core.capture_backward.__module__)
    measured = [name for name in getattr(engine, "INSTRUMENTS", ()) if name != "optimizer"] or None
    fresh_heap()
    started = now()
    result = graphviz_core.capture_backward(config, instruments=measured)
    r.record("capture", started)  # the build inside is subtracted in finish()
    r.extra["nodes"] = result.summary.nodes
    r.extra["our peak"] = result.memory.peak_bytes
    if result.timeline is not None:
        r.extra["our activation peak"] = result.timeline.activation_peak_bytes
    r.extra["capture own fwd+bwd"] = (result.time.forward_s or 0.0) + (result.time.backward_s or 0.0)
    del result


def graph_only_instruments(given: str | None) -> frozenset[str] | None:
    """What the graph-only run asks for: `--instruments` when given, else the engine's GRAPH_ONLY (else "graph");
    None where this build's capture_backward takes no `instruments=`."""
    if "instruments" not in inspect.signature(graphviz_core.capture_backward).parameters:
        return None
    if given is not None:
        return frozenset(i.strip() for i in given.split(",") if i.strip())
    engine = importlib.import_module(graphviz_core.capture_backward.__module__)
    return frozenset(getattr(engine, "GRAPH_ONLY", {"graph"}))


def graph_only_variant(instruments: frozenset[str]) -> Callable[[ModelConfig, Round], None]:
    """The capture with only the graph's instruments."""

    def graph_only(config: ModelConfig, r: Round) -> None:
        fresh_heap()
        started = now()
        result = graphviz_core.capture_backward(config, instruments=instruments)
        r.record("graph-only", started)
        r.extra["graph-only nodes"] = result.summary.nodes
        del result

    return graph_only


def finish(r: Round) -> None:
    """Take the build out of the captures' end-to-end seconds: this round's median timed build (wall and CPU)."""
    build = statistics.median(b[0] for b in r.builds)
    r.extra["build s"] = build
    build_cpu = statistics.median(b[1] for b in r.builds)
    for name in ("capture", "graph-only"):
        if name in r.seconds:
            r.seconds[name] -= build
            r.cpu[name] -= build_cpu


def run_rounds(config: ModelConfig, variants: dict, rounds: int) -> list[Round]:
    warm = Round()
    for step in variants.values():  # untimed: the process's one-time costs (warm-up captures, profiler start)
        step(config, warm)
    names = list(variants)
    done = []
    for i in range(rounds):
        r = Round()
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            variants[name](config, r)
        finish(r)
        done.append(r)
        ratios = ", ".join(
            f"{n} {r.seconds[n] / r.seconds['bare']:.3f}x (CPU {r.cpu[n] / r.cpu['bare']:.3f}x)"
            for n in names
            if n != "bare"
        )
        print(
            f"  round {i + 1} ({' -> '.join(order)}): bare {r.seconds['bare']:.3f} s; {ratios}; "
            f"build {r.extra['build s']:.3f} s",
            flush=True,
        )
    return done


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--instruments", help="comma-separated instruments of the graph-only run (default: the engine's GRAPH_ONLY)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: gpt2-tiny at its own batch and seq, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.batch, args.seq, args.rounds = "gpt2-tiny", None, None, 3
    config = config_from_preset(args.preset, batch=args.batch, seq=args.seq, device="cpu")
    name = f"{args.preset} b={config.batch} s={config.seq}"
    variants = {"bare": bare, "profiler": profiler, "memtracker": memtracker, "capture": capture}
    print(
        f"{name} on CPU: torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} paired "
        f"rounds, order rotating; at the start: {load()}"
    )
    instruments = graph_only_instruments(args.instruments)
    graph_only = None
    if instruments is not None:
        graph_only = graph_only_variant(instruments)
        try:  # a build whose capture_backward takes `instruments=` but not these names says so here
            graph_only(config_from_preset("gpt2-tiny", device="cpu"), Round())
            variants["graph-only"] = graph_only
        except ValueError as exc:
            print(f"graph-only: not available in this build (instruments={sorted(instruments)}: {exc})")
            graph_only = None
    print(
        "ratios to bare: wall clock, and the main thread's CPU time (time.thread_time: it leaves out waiting for a "
        "core, so other work on the machine moves it far less, and the intra-op worker threads' share)"
    )
    print(
        "build excluded: bare, profiler and memtracker build model + batch before their timer starts; capture and "
        "graph-only build inside capture_backward, so each round's median of the other variants' timed "
        "build_model(config) + make_batch(config) is subtracted from their end-to-end seconds (no monkeypatching); "
        "every variant starts on a trimmed heap (gc.collect + malloc_trim(0), untimed), as a capture leaves it"
    )
    if instruments is None:
        print("graph-only: not available in this build")
    rounds = run_rounds(config, variants, args.rounds)
    at_end = load()

    def median(name: str) -> float:
        return statistics.median(r.seconds[name] for r in rounds)

    def ratio(name: str, cpu: bool = False) -> float:
        if cpu:
            return statistics.median(r.cpu[name] / r.cpu["bare"] for r in rounds)
        return statistics.median(r.seconds[name] / r.seconds["bare"] for r in rounds)

    def both(name: str) -> str:
        return f"{ratio(name):.2f}x wall, {ratio(name, cpu=True):.2f}x main-thread CPU"

    def extra(key: str) -> float:
        return statistics.median(r.extra[key] for r in rounds)

    last = rounds[-1].extra
    nodes = last["nodes"]
    print(f"at the end: {at_end}")
    bare_cpu = statistics.median(r.cpu["bare"] for r in rounds)
    print(f"bare: median {median('bare'):.3f} s (forward + loss + backward), main-thread CPU {bare_cpu:.3f} s")
    for variant in variants:
        if variant != "bare":
            each = ", ".join(f"{r.seconds[variant] / r.seconds['bare']:.3f}" for r in rounds)
            print(
                f"{variant}: median {median(variant):.3f} s, {ratio(variant):.3f}x bare wall, "
                f"{ratio(variant, cpu=True):.3f}x main-thread CPU (per-round wall ratios {each})"
            )
    parse = extra("profiler parse s")
    with_parse = statistics.median(
        (r.seconds["profiler"] + r.extra["profiler parse s"]) / r.seconds["bare"] for r in rounds
    )
    print(
        f"  profiler: parsing its events (prof.events()) {parse:.3f} s more, {with_parse:.3f}x bare with it; "
        f"{last['profiler events']} events, {last['profiler node events']} autograd-node events "
        f"(our graph: {nodes} nodes)"
    )
    ours = last["our peak"]
    theirs = last["memtracker peak"]
    kinds = ", ".join(f"{k} {v / MiB:.1f}" for k, v in last["memtracker by kind"].items())
    print(
        f"  memory peak: MemTracker {theirs / MiB:.1f} MiB ({kinds}) vs ours {ours / MiB:.1f} MiB "
        f"({ours / theirs:.3f}x; our activation peak {last.get('our activation peak', 0) / MiB:.1f} MiB)"
    )
    own = statistics.median(r.extra["capture own fwd+bwd"] / r.seconds["bare"] for r in rounds)
    print(
        f"  capture: build subtracted median {extra('build s'):.3f} s; its own forward+backward timers alone "
        f"{own:.3f}x bare; {nodes} nodes"
    )
    if graph_only is not None:
        print(f"  graph-only: instruments={sorted(instruments)}, {last['graph-only nodes']} nodes")

    paired = f"paired median of {args.rounds}; {at_end}"
    row(f"{name} CPU: bare forward+backward (`bench_peers.py`)", f"{median('bare'):.2f} s ({paired})", "-")
    row(
        f"{name} CPU: torch.profiler CPU vs bare ({last['profiler node events']} autograd-node events)",
        f"{both('profiler')}; with parsing its events {with_parse:.2f}x wall",
        "-",
    )
    row(
        f"{name} CPU: MemTracker vs bare",
        f"{both('memtracker')}; peak {theirs / MiB:.0f} MiB vs ours {ours / MiB:.0f} MiB",
        "-",
    )
    row(f"{name} CPU: our full capture vs bare ({nodes:,} nodes; build subtracted)", both("capture"), "-")
    if graph_only is not None:
        row(f"{name} CPU: our graph-only capture vs bare (build subtracted)", both("graph-only"), "-")
    else:
        row(f"{name} CPU: our graph-only capture vs bare", "not available in this build", "-")


if __name__ == "__main__":
    main()
