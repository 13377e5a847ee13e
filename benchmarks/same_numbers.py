"""Prove that a refactor changed no number: dump every CLI JSON output for a fixed set of configs, compare two dumps.

    python benchmarks/same_numbers.py dump --repo /work/baseline -o /tmp/numbers-before.json [--jobs 2]
    python benchmarks/same_numbers.py dump --repo . -o /tmp/numbers-after.json
    python benchmarks/same_numbers.py compare /tmp/numbers-before.json /tmp/numbers-after.json

Only the public CLI contract is driven (`python -m graphviz_core ...` with cwd and PYTHONPATH = the repo), so the
same script runs against the code before and after a move of modules. Every config is a fresh process on cpu or
meta with the default seed; measured timings are dropped (see `strip`), everything else is kept and compared
exactly: config, loss, grad norms, summary, memory, timeline, FLOPs, save order, every node id, edge and node
attribute of the graph's node-link data, per-rank parallel numbers, compare/memory/expr outputs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TINY = ["mlp", "gpt2-tiny", "transformer-block", "llama-tiny", "mistral-tiny", "qwen2-tiny", "mixtral-tiny", "gpt2-hf-tiny",
        "bert-tiny", "vit-tiny", "resnet-tiny"]
MODEL_FILE = "{MODEL_FILE}"  # replaced by the factory file written into a temp dir
FACTORY = '''import torch
from torch import nn


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    return model, x, lambda out: nn.functional.mse_loss(out, y)
'''


def configs() -> dict[str, list[str]]:
    """name -> argv after `python -m graphviz_core`."""
    out: dict[str, list[str]] = {}

    def graph(name: str, *flags: str) -> None:
        out[f"graph {name}"] = ["graph", *flags, "--format", "json"]

    for device in ("cpu", "meta"):  # every family, its tiny preset (block: the default `--model block`)
        for preset in TINY:
            graph(f"{preset} {device}", "--preset", preset, "--device", device)
        graph(f"block {device}", "--model", "block", "--device", device)
    # big presets on meta, cut to 2 layers
    graph("llama-3.1-8b L2 meta", "--preset", "llama-3.1-8b", "--layers", "2", "--device", "meta")
    graph("mixtral-8x7b L2 s512 meta", "--preset", "mixtral-8x7b", "--layers", "2", "--seq", "512", "--device", "meta")
    graph("qwen2.5-7b L2 s1024 meta", "--preset", "qwen2.5-7b", "--layers", "2", "--seq", "1024", "--device", "meta")
    graph("gpt2-small meta", "--preset", "gpt2-small", "--device", "meta")
    graph("bert-base meta", "--preset", "bert-base", "--device", "meta")
    graph("resnet-50 meta", "--preset", "resnet-50", "--device", "meta")
    # checkpointing
    for preset, policy, device in [("mlp", "full", "cpu"), ("gpt2-tiny", "full", "cpu"), ("gpt2-tiny", "selective", "cpu"),
                                   ("llama-tiny", "full", "cpu"), ("llama-tiny", "selective", "cpu"),
                                   ("bert-tiny", "selective", "meta"), ("mixtral-tiny", "full", "meta")]:
        graph(f"{preset} ckpt-{policy} {device}", "--preset", preset, "--checkpoint", policy, "--device", device)
    graph("llama-3.1-8b L2 ckpt-selective meta", "--preset", "llama-3.1-8b", "--layers", "2", "--checkpoint",
          "selective", "--device", "meta")
    # attention variants
    for preset, attention in [("gpt2-tiny", "manual"), ("gpt2-tiny", "mha"), ("transformer-block", "sdpa"),
                              ("transformer-block", "manual"), ("llama-tiny", "eager"), ("gpt2-hf-tiny", "eager"),
                              ("bert-tiny", "eager"), ("vit-tiny", "eager")]:
        graph(f"{preset} attn-{attention} cpu", "--preset", preset, "--attention", attention, "--device", "cpu")
    # bfloat16 on meta
    for preset in ("gpt2-tiny", "llama-tiny", "mixtral-tiny"):
        graph(f"{preset} bf16 meta", "--preset", preset, "--dtype", "bfloat16", "--device", "meta")
    # parallel strategies (per_rank)
    for name, flags in [
        ("llama-tiny fsdp w4 cpu", ["--preset", "llama-tiny", "--device", "cpu", "--strategy", "fsdp", "--world-size", "4"]),
        ("gpt2-tiny tp2 cpu", ["--preset", "gpt2-tiny", "--device", "cpu", "--strategy", "tp", "--world-size", "2",
                               "--tp", "2"]),
        ("llama-tiny fsdp+tp w4 tp2 meta", ["--preset", "llama-tiny", "--device", "meta", "--strategy", "fsdp+tp",
                                            "--world-size", "4", "--tp", "2"]),
        ("resnet-tiny ddp w4 cpu", ["--preset", "resnet-tiny", "--device", "cpu", "--strategy", "ddp", "--world-size", "4"]),
        ("llama-tiny hsdp w8 g4 meta", ["--preset", "llama-tiny", "--device", "meta", "--strategy", "hsdp",
                                        "--world-size", "8", "--shard-group", "4"]),
        ("gpt2-tiny fsdp w2 bf16-mp no-reshard meta", ["--preset", "gpt2-tiny", "--device", "meta", "--strategy", "fsdp",
                                                       "--world-size", "2", "--mixed-precision", "bf16",
                                                       "--no-reshard-after-forward"]),
        # bfloat16: in float32 every mixtral strategy fails here (torch._grouped_mm wants BF16 inputs)
        ("mixtral-tiny bf16 tp2 meta", ["--preset", "mixtral-tiny", "--device", "meta", "--dtype", "bfloat16",
                                        "--strategy", "tp", "--world-size", "2", "--tp", "2"]),
        ("llama-3.1-8b L2 fsdp+tp w16 tp8 meta", ["--preset", "llama-3.1-8b", "--layers", "2", "--device", "meta",
                                                  "--strategy", "fsdp+tp", "--world-size", "16", "--tp", "8"]),
        # context, sequence and pipeline parallel; the step's choices (LoRA, optimizer, autocast) on every rank
        ("llama-tiny fsdp w4 cp2 meta", ["--preset", "llama-tiny", "--device", "meta", "--strategy", "fsdp",
                                         "--world-size", "4", "--cp", "2"]),
        ("llama-tiny fsdp+tp w4 tp2 sp meta", ["--preset", "llama-tiny", "--device", "meta", "--strategy", "fsdp+tp",
                                               "--world-size", "4", "--tp", "2", "--sequence-parallel"]),
        ("llama-tiny w2 pp2 gpipe meta", ["--preset", "llama-tiny", "--device", "meta", "--strategy", "none",
                                       "--world-size", "2", "--pp", "2", "--schedule", "gpipe"]),
        ("llama-tiny fsdp w4 pp2 1f1b meta", ["--preset", "llama-tiny", "--device", "meta", "--strategy", "fsdp",
                                              "--world-size", "4", "--pp", "2", "--schedule", "1f1b"]),
        ("llama-tiny fsdp w4 pp2 interleaved meta", ["--preset", "llama-tiny", "--layers", "4", "--batch", "4", "--device", "meta",
                                                     "--strategy", "fsdp", "--world-size", "4", "--pp", "2",
                                                     "--schedule", "interleaved-1f1b", "--stages-per-rank", "2"]),
        ("llama-tiny fsdp w8 pp2 cp2 meta", ["--preset", "llama-tiny", "--device", "meta", "--strategy", "fsdp",
                                             "--world-size", "8", "--pp", "2", "--cp", "2"]),
        ("llama-tiny fsdp+tp w8 tp2 pp2 sp meta", ["--preset", "llama-tiny", "--device", "meta", "--strategy",
                                                   "fsdp+tp", "--world-size", "8", "--tp", "2", "--pp", "2",
                                                   "--sequence-parallel"]),
        ("llama-tiny fsdp w4 lora meta", ["--preset", "llama-tiny", "--device", "meta", "--strategy", "fsdp",
                                          "--world-size", "4", "--finetune", "lora"]),
        ("llama-tiny fsdp+tp w4 tp2 lora sp meta", ["--preset", "llama-tiny", "--device", "meta", "--strategy",
                                                    "fsdp+tp", "--world-size", "4", "--tp", "2", "--finetune", "lora",
                                                    "--sequence-parallel"]),
        ("llama-tiny fsdp w4 bf16-autocast sgd meta", ["--preset", "llama-tiny", "--device", "meta", "--strategy",
                                                       "fsdp", "--world-size", "4", "--autocast", "bfloat16",
                                                       "--optimizer", "sgd"]),
        ("gpt2-tiny ddp w2 fp16-autocast adafactor meta", ["--preset", "gpt2-tiny", "--device", "meta", "--strategy",
                                                           "ddp", "--world-size", "2", "--autocast", "float16",
                                                           "--optimizer", "adafactor"]),
    ]:
        graph(name, *flags)
    out["plan llama-tiny 8 gpus pp 1,2 cp 1,2"] = ["plan", "--preset", "llama-tiny", "--device", "meta", "--gpus", "8",
                                                   "--global-batch", "8", "--pp-degrees", "1,2", "--cp-degrees", "1,2",
                                                   "--format", "json"]
    graph("model-file tiny-mlp", "--model-file", f"{MODEL_FILE}:make")
    # memory panel
    out["memory gpt2-tiny cpu checkpoints budget1"] = ["memory", "--preset", "gpt2-tiny", "--device", "cpu",
                                                       "--checkpoints", "--budget-gib", "1"]
    out["memory mlp cpu sgd"] = ["memory", "--preset", "mlp", "--device", "cpu", "--optimizer", "sgd"]
    out["memory llama-tiny meta checkpoints 80GB"] = ["memory", "--preset", "llama-tiny", "--device", "meta",
                                                      "--checkpoints", "--accelerator", "80 GB"]
    out["memory bert-tiny cpu ckpt-full adam"] = ["memory", "--preset", "bert-tiny", "--device", "cpu", "--checkpoint",
                                                  "full", "--optimizer", "adam"]
    out["memory llama-3.1-8b L2 meta ckpt-selective"] = ["memory", "--preset", "llama-3.1-8b", "--layers", "2",
                                                         "--device", "meta", "--checkpoint", "selective"]
    # compare
    out["compare gpt2-tiny sdpa vs manual cpu"] = ["compare", "--preset", "gpt2-tiny", "--device", "cpu", "--vs",
                                                   "--attention", "manual"]
    out["compare llama-tiny vs mistral-tiny meta"] = ["compare", "--preset", "llama-tiny", "--device", "meta", "--vs",
                                                      "--preset", "mistral-tiny", "--device", "meta",
                                                      "--checkpoint", "selective"]
    # toy expressions
    out["expr (a*b+c)**2"] = ["expr", "(a*b + c)**2", "a=2", "b=-3", "c=10"]
    out["expr tanh/exp/log"] = ["expr", "tanh(x*w + b) + exp(x) * log(w)", "x=0.5", "w=1.5", "b=-0.25"]
    out["expr reuse x*x + x/y"] = ["expr", "x*x + x/y - y", "x=3", "y=-2"]
    return out


# Measured wall-clock values (differ on every run): the capture's `time` block, each node's measured `time_s`,
# `simulate_s` (how long the parallel simulation took), `extra_time_s` (a fraction x a measured step time), and
# any other `*_s`. Modelled times (bytes / link bandwidth) are deterministic and kept: collective times, link speeds.
MODELLED = {"collective_time_s", "backward_collective_time_s"}


def strip(value, parent: str = ""):
    if isinstance(value, dict):
        kept = {}
        for key, item in value.items():
            modelled = key in MODELLED or key.endswith("_per_s") or (key == "time_s" and parent == "collectives")
            if key == "time" or (key.endswith("_s") and not modelled):
                continue
            if key == "allocator_bytes" and item is not None:  # torch.cuda.memory_allocated(): None off CUDA
                continue
            if key in ("a", "b", "delta") and value.get("unit") == "s":  # compare's "Forward + backward time" row
                continue
            kept[key] = strip(item, key)
        return kept
    if isinstance(value, list):
        return [strip(item, parent) for item in value]
    return value


def run_one(python: str, repo: Path, tmp: str, argv: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHVIZ_CORE_")}  # no device override etc.
    # no worker pool: every meta capture in the CLI's own process; one thread so CPU float sums are reproducible
    env.update(PYTHONPATH=str(repo), GRAPHVIZ_CORE_META_PROCESSES="0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    real = [a.replace(MODEL_FILE, f"{tmp}/tiny_model.py") for a in argv]
    started = time.perf_counter()
    proc = subprocess.run([python, "-m", "graphviz_core", *real], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=900)
    entry = {"command": ["python", "-m", "graphviz_core", *argv], "returncode": proc.returncode,
             "seconds": round(time.perf_counter() - started, 2)}
    if proc.returncode:
        entry["error"] = proc.stderr.replace(tmp, "<tmp>").strip().splitlines()[-1:] or ["(no stderr)"]
    else:
        entry["output"] = strip(json.loads(proc.stdout.replace(tmp, "<tmp>")))
    return entry


def dump(args: argparse.Namespace) -> int:
    repo = Path(args.repo).resolve()
    todo = {name: argv for name, argv in configs().items() if not args.only or any(word in name for word in args.only)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="same_numbers_") as tmp:
        Path(tmp, "tiny_model.py").write_text(FACTORY, encoding="utf-8")
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {name: pool.submit(run_one, args.python, repo, tmp, argv) for name, argv in todo.items()}
            results = {}
            for name, future in futures.items():
                results[name] = future.result()
                r = results[name]
                print(f"{r['seconds']:7.1f} s  {'ok  ' if not r['returncode'] else 'FAIL'}  {name}", flush=True)
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    data = {"repo": str(repo), "commit": commit.strip(), "configs": results}
    Path(args.output).write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    failed = [name for name, r in results.items() if r["returncode"]]
    print(f"{len(results)} configs in {time.perf_counter() - started:.0f} s -> {args.output}; {len(failed)} failed")
    for name in failed:
        print(f"  FAILED {name}: {results[name]['error']}")
    return 1 if failed else 0


def label(item, index: int) -> str:
    return f"[id={item['id']}]" if isinstance(item, dict) and "id" in item else f"[{index}]"


def short(value) -> str:
    text = repr(value)
    return text if len(text) <= 100 else f"{text[:90]}... ({type(value).__name__})"


def differences(a, b, path: str = ""):
    """Paths where `a` and `b` differ; floats exactly (NaN equals NaN), dict keys and list lengths included."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            if key not in a or key not in b:
                yield f"{path}.{key}: {'missing before' if key not in a else 'missing after'}"
            else:
                yield from differences(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{path}: length {len(a)} -> {len(b)}"
        for index, (x, y) in enumerate(zip(a, b, strict=False)):
            yield from differences(x, y, path + label(x, index))
    elif type(a) is not type(b) or a != b:
        if not (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
            yield f"{path}: {short(a)} -> {short(b)}"


def compare(args: argparse.Namespace) -> int:
    before = json.loads(Path(args.before).read_text(encoding="utf-8"))["configs"]
    after = json.loads(Path(args.after).read_text(encoding="utf-8"))["configs"]
    differ = 0
    for name in sorted(before.keys() | after.keys()):
        if name not in before or name not in after:
            found = [f"only in {'after' if name not in before else 'before'}"]
        else:
            a, b = before[name], after[name]
            found = list(differences({k: a.get(k) for k in ("command", "returncode", "error", "output")},
                                     {k: b.get(k) for k in ("command", "returncode", "error", "output")}))
            if a["returncode"] or b["returncode"]:
                found.append(f"failed: {a.get('error')} / {b.get('error')}")
        differ += bool(found)
        print(f"{name}: {'same' if not found else f'DIFFERS ({len(found)} paths)'}")
        for line in found[:10]:
            print(f"    {line}")
    total = len(before.keys() | after.keys())
    print(f"{total} configs, {total - differ} equal, {differ} differ")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    d = commands.add_parser("dump", help="run every config against --repo and write the numbers as JSON")
    d.add_argument("--repo", default=".", help="repository root whose graphviz_core to run (default: .)")
    d.add_argument("-o", "--output", required=True)
    d.add_argument("--jobs", type=int, default=2, help="configs run at once, each in its own process (default 2)")
    d.add_argument("--python", default=sys.executable, help="interpreter with torch etc. (default: this one)")
    d.add_argument("--only", action="append", default=[], metavar="WORD",
                   help="run only the configs whose name holds WORD (repeat for any of several); e.g. --only fsdp")
    c = commands.add_parser("compare", help="compare two dumps; exit 1 if any config differs")
    c.add_argument("before")
    c.add_argument("after")
    args = parser.parse_args()
    return dump(args) if args.command == "dump" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
