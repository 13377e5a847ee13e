"""What the debugging instruments cost (issue 36): the recorder, the recorder with `check_forward=True`, and
torch.autograd.detect_anomaly (check_nan), each beside the bare loop, in paired rounds in one process.

One transformers GPT-2 (random weights; by default 2 layers, width 64, b=4, s=64, one CPU thread) trains with AdamW.
Each round runs every variant for `--steps` steps after one warm-up step; the table gives each variant's median over
the rounds of its mean step time, and its ratio to the bare loop's.

    python benchmarks/bench_debug.py [--steps 5] [--rounds 5] [--layers 2 --hidden 64 --batch 4 --seq 64]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time

import torch

import graphviz_core


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in (("steps", 5), ("rounds", 5), ("layers", 2), ("hidden", 64), ("batch", 4), ("seq", 64)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=4, vocab_size=512, n_positions=args.seq,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 512, (args.batch, args.seq))

    def loop(n: int) -> None:
        for _ in range(n):
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()

    folder = tempfile.mkdtemp(prefix="bench-debug-")
    variants = {
        "bare loop": contextlib.nullcontext,
        "recorder": lambda: graphviz_core.record(f"{folder}/run", model=model),
        "recorder + check_forward": lambda: graphviz_core.record(f"{folder}/run", model=model, check_forward=True),
        "detect_anomaly(check_nan)": lambda: torch.autograd.detect_anomaly(check_nan=True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, make in variants.items():
            shutil.rmtree(f"{folder}/run", ignore_errors=True)
            with make():
                loop(1)
                started = time.perf_counter()
                loop(args.steps)
                times[name].append((time.perf_counter() - started) / args.steps)
    shutil.rmtree(folder, ignore_errors=True)
    bare = statistics.median(times["bare loop"])
    print("| variant | ms per step | x bare loop |")  # noqa: T201
    print("| --- | ---: | ---: |")  # noqa: T201
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1000:.1f} | {median / bare:.2f} |")  # noqa: T201


if __name__ == "__main__":
    main()
