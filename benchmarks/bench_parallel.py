"""Per-rank figures for Llama-3.1-70B under FSDP 64 x TP 8 (512 ranks), seq 8192: time and peak RSS vs goals.

The model is Hugging Face's LlamaForCausalLM built from a LlamaConfig with Llama-3.1-70B's public numbers
(config.json of meta-llama/Llama-3.1-70B): hidden 8192, 80 layers, 64 heads, 8 key/value heads, MLP 28672,
vocabulary 128256, untied embeddings, bfloat16. Nothing is downloaded: random weights on meta, fake tensors.
Goals (issue 11): per-rank figures in <= 60 s on this 2-core machine, peak RSS <= 4 GB.

    python benchmarks/bench_parallel.py [--layers N] [--single-device]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.nn.functional as F

from graphviz_core.parallel import Workload, simulate_workload
from graphviz_core.parallel_config import ParallelConfig
from graphviz_core.ui.format import format_bytes, format_seconds

GOAL_S = 60.0
GOAL_RSS_BYTES = 4 * 2**30
LLAMA_31_70B = dict(
    hidden_size=8192,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def llama_workload(layers: int, batch: int, seq: int) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_31_70B, "num_hidden_layers": layers})
    vocab = config.vocab_size

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return LlamaForCausalLM(config).to(torch.bfloat16)

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros((batch, seq), dtype=torch.long), torch.zeros((batch, seq), dtype=torch.long)

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.view(-1, vocab), targets.view(-1))  # (B*T, V) vs (B*T,)

    return Workload(build, inputs, loss, torch.bfloat16, forward=lambda model, x: model(input_ids=x).logits)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--world-size", type=int, default=512)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--single-device", action="store_true", help="also time the one-device comparison run")
    args = parser.parse_args()
    parallel = ParallelConfig("fsdp+tp", args.world_size, tp=args.tp)
    workload = llama_workload(args.layers, 1, args.seq)
    print(f"Llama-3.1-70B shape, {args.layers} layers, b=1 s={args.seq}, bf16; {parallel}")
    started = time.perf_counter()
    result = simulate_workload(workload, parallel)
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
    if args.single_device:
        started = time.perf_counter()
        alone = simulate_workload(workload, ParallelConfig())
        print(f"one device: peak {format_bytes(alone.peak_bytes)}, simulated in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
