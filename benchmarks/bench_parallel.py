"""Per-rank figures for Llama-3.1-70B under FSDP 64 x TP 8 (512 ranks), seq 8192: time and peak RSS vs goals.

The model is the `llama-3.1-70b` preset: Hugging Face's LlamaForCausalLM built from Llama-3.1-70B's public
config (hidden 8192, 80 layers, 64 heads, 8 key/value heads, MLP 28672, vocabulary 128256, untied embeddings),
bfloat16, b=1. Nothing is downloaded: random weights on meta, fake tensors.
Goals (issue 11): per-rank figures in <= 60 s on this 2-core machine, peak RSS <= 4 GB.

    python benchmarks/bench_parallel.py [--layers N] [--single-device]
"""

from __future__ import annotations

import argparse
import resource
import time

from readme_rows import row

from graphviz_core.config import config_from_preset
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.parallel.simulate import simulate_parallel
from graphviz_core.ui.format import format_bytes, format_seconds

GOAL_S = 60.0
GOAL_RSS_BYTES = 4 * 2**30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--world-size", type=int, default=512)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--single-device", action="store_true", help="also time the one-device comparison run")
    args = parser.parse_args()
    parallel = ParallelConfig("fsdp+tp", args.world_size, tp=args.tp)
    config = config_from_preset("llama-3.1-70b", layers=args.layers, seq=args.seq)
    print(f"{config.describe()}; {parallel}")
    started = time.perf_counter()
    result = simulate_parallel(config, parallel, single_device=False)
    took = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(f"parameters: {result.parameter_count:,} in total")
    print(
        f"rank 0: parameters {format_bytes(result.parameter_bytes)} (closed form {format_bytes(result.expected.parameter_bytes)})"
    )
    print(
        f"rank 0: gradients {format_bytes(result.gradient_bytes)}, optimizer state {format_bytes(result.optimizer_bytes)}"
    )
    for phase in result.phases:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in phase.parts_bytes.items() if v)
        print(f"rank 0: {phase.phase} peak {format_bytes(phase.peak_bytes)} = {parts}")
    print(
        f"rank 0: {len(result.collectives)} collectives, {format_bytes(result.collective_bytes())} sent per step "
        f"({format_bytes(result.collective_bytes('backward'))} in backward, "
        f"{format_seconds(result.collective_time_s('backward'))} at the stated links)"
    )
    print(f"{'what':<34}{'measured':>12}{'goal':>12}{'ratio':>8}")
    print(f"{'per-rank figures, wall time':<34}{took:>11.1f}s{GOAL_S:>11.0f}s{took / GOAL_S:>8.2f}")
    print(f"{'peak RSS':<34}{rss / 2**30:>10.2f}GiB{GOAL_RSS_BYTES / 2**30:>9.0f}GiB{rss / GOAL_RSS_BYTES:>8.2f}")
    row(f"Llama-3.1-70B ({args.layers} layers, s={args.seq}), FSDP {args.world_size // args.tp} x TP {args.tp}: rank 0's "
        "figures (`bench_parallel.py`)", f"{took:.1f} s, peak RSS {rss / 2**30:.2f} GiB",
        f"<= {GOAL_S:.0f} s, <= {GOAL_RSS_BYTES / 2**30:.0f} GiB")
    if args.single_device:
        started = time.perf_counter()
        alone = simulate_parallel(config, ParallelConfig())
        print(f"one device: peak {format_bytes(alone.peak_bytes)}, simulated in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
