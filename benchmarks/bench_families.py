"""Real architectures on this machine: Llama 3.1 8B / 70B / 405B captured on meta (time and peak memory), and a
tiny Llama's full CPU capture against its bare forward + backward.

Goals (issue 7): 8B at s=8192, b=1 on meta in <= 10 s; 70B in <= 60 s with peak RSS <= 4 GB; 405B completes
(reported); tiny Llama on CPU: capture <= 1.3x bare forward + backward (median of paired runs, same process).
Each meta run is a fresh process, so its peak RSS (ru_maxrss) is its own, imports included.

    python benchmarks/bench_families.py [--repeats N] [--skip-405b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from readme_rows import row

META_GOALS = {"llama-3.1-8b": (10.0, None), "llama-3.1-70b": (60.0, 4.0), "llama-3.1-405b": (None, None)}

CHILD = """
import json, resource, sys, time
started = time.perf_counter()
from graphviz_core.capture import capture_backward
from graphviz_core.config import config_from_preset
from graphviz_core.families import transformers_for
config = config_from_preset(sys.argv[1])
imported = time.perf_counter()
transformers_for(config.model)  # transformers' own imports for the family (torch._dynamo, DTensor): once a process
family_imported = time.perf_counter()
capture = capture_backward(config)
done = time.perf_counter()
again = capture_backward(config)
second = time.perf_counter()
print(json.dumps(dict(
    import_s=imported - started, family_import_s=family_imported - imported, capture_s=done - family_imported,
    second_capture_s=second - done, nodes=capture.summary.nodes,
    parameters=capture.summary.parameter_count, saved_bytes=capture.memory.saved_bytes,
    backward_flops=capture.flops.backward, peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
)))
"""


def meta_run(preset: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, preset], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def tiny_llama_ratio(repeats: int) -> None:
    import torch

    from graphviz_core.capture import capture_backward
    from graphviz_core.config import config_from_preset
    from graphviz_core.models import build_model, compute_loss, make_batch

    config = config_from_preset("llama-tiny", device="cpu")

    def bare() -> float:
        # Build, forward, loss, backward: what the capture does, with no instrumentation.
        started = time.perf_counter()
        model = build_model(config)
        batch = make_batch(config, "cpu")
        compute_loss(config, model(batch.inputs), batch.targets).backward()
        del model, batch
        return time.perf_counter() - started

    def captured() -> float:
        started = time.perf_counter()
        capture = capture_backward(config)
        del capture
        return time.perf_counter() - started

    bare(), captured()  # warm-up: imports, allocator, kernels
    pairs = [(bare(), captured()) for _ in range(repeats)]
    ratios = [c / b for b, c in pairs]
    b, c = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    print(
        f"tiny Llama on CPU (torch threads {torch.get_num_threads()}): bare build+forward+backward median "
        f"{b * 1000:.1f} ms, full capture median {c * 1000:.1f} ms"
    )
    print(f"  paired ratios {[round(r, 2) for r in ratios]}: median {statistics.median(ratios):.2f}x (goal <= 1.3x)")
    row("llama-tiny on CPU: capture vs bare build + forward + backward",
        f"{statistics.median(ratios):.2f}x (paired median of {repeats}; {c * 1000:.1f} vs {b * 1000:.1f} ms)", "<= 1.3x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-405b", action="store_true")
    args = parser.parse_args()
    for preset, (time_goal, rss_goal) in META_GOALS.items():
        if preset == "llama-3.1-405b" and args.skip_405b:
            continue
        r = meta_run(preset)
        rss_gib = r["peak_rss_bytes"] / 2**30
        goals = []
        if time_goal:
            goals.append(f"time goal <= {time_goal:g} s: {'met' if r['capture_s'] <= time_goal else 'MISSED'}")
        if rss_goal:
            goals.append(f"RSS goal <= {rss_goal:g} GB: {'met' if r['peak_rss_bytes'] <= rss_goal * 1e9 else 'MISSED'}")
        print(
            f"{preset} (s=8192, b=1, bf16, meta): capture {r['capture_s']:.1f} s, "
            f"{r['capture_s'] * 1000 / r['nodes']:.2f} ms/node (goal <= 0.4: "
            f"{'met' if r['capture_s'] * 1000 / r['nodes'] <= 0.4 else 'MISSED'}); again in the same process "
            f"{r['second_capture_s']:.1f} s ({r['second_capture_s'] * 1000 / r['nodes']:.2f} ms/node); once a process: "
            f"{r['import_s']:.1f} s importing torch + graphviz_core, {r['family_import_s']:.1f} s transformers' modules; "
            f"peak RSS {rss_gib:.2f} GiB ({r['peak_rss_bytes'] / 1e9:.2f} GB), {r['nodes']:,} nodes, "
            f"{r['parameters']:,} parameters, saved {r['saved_bytes'] / 2**30:.1f} GiB, "
            f"backward {r['backward_flops']:.3g} FLOP" + ("; " + "; ".join(goals) if goals else "")
        )
        goal = ", ".join(g for g in (time_goal and f"<= {time_goal:g} s", rss_goal and f"<= {rss_goal:g} GB") if g)
        row(f"{preset}, s=8192, b=1, bf16 on meta: graph + bytes + FLOPs, first capture of a fresh process "
            "(`bench_families.py`)",
            f"{r['capture_s']:.1f} s ({r['nodes']:,} nodes, {r['capture_s'] * 1000 / r['nodes']:.2f} ms/node; "
            f"{r['second_capture_s'] * 1000 / r['nodes']:.2f} ms/node again), peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB; "
            f"once a process before it: {r['family_import_s']:.1f} s importing transformers' {preset.split('-')[0]}",
            f"{goal or 'completes'}; <= 0.4 ms/node")
    tiny_llama_ratio(args.repeats)


if __name__ == "__main__":
    main()
