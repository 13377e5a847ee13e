"""Which attention kernel this machine's F.scaled_dot_product_attention runs, by dtype, grouped-query heads and mask.

The meta dry runs (graphviz_core.capture.meta_kernels) and the parallel simulation (fake CPU tensors) name the
kernel a CUDA run would take instead of running it; this prints what the GPU really takes, forward and backward,
for the cases they distinguish, so that their table can be checked against it:

    python benchmarks/gpu_sdpa_choice.py [--device cuda] [--dry-runs]

With --dry-runs (on a GPU) it also sets a meta dry run of a few presets beside their real capture on the GPU: the
attention nodes each shows and the saved bytes.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from gpu_step_check import HighWater, OpCensus, held_inside  # benchmarks/ is on the path


def choice(device: str, dtype, heads: int, kv_heads: int, head_dim: int, mask: str, seq: int = 256) -> dict:
    """The ops of one SDPA forward and backward (batch 2) on `device`."""
    q = torch.randn(2, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    kwargs = {"enable_gqa": kv_heads != heads}
    if mask == "causal":
        kwargs["is_causal"] = True
    elif mask == "boolean":
        kwargs["attn_mask"] = torch.ones(seq, seq, device=device, dtype=torch.bool).tril()
    with OpCensus() as census:
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        out.sum().backward()
    return census.counts()


DRY_RUNS = (
    ("gpt2-tiny", {}),
    ("llama-tiny", {}),
    ("llama-tiny", {"dtype": "bfloat16"}),
    ("llama-tiny", {"autocast": "bfloat16"}),
    ("gemma3-tiny", {}),
    ("bert-tiny", {}),
)


def dry_runs() -> None:
    """Each preset's attention nodes and saved bytes, a meta dry run (auto picks CUDA) beside a real CUDA capture."""
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.config import config_from_preset

    for preset, fields in DRY_RUNS:
        try:
            real = capture_backward(config_from_preset(preset, device="cuda", **fields))
            dry = capture_backward(config_from_preset(preset, device="meta", **fields))
        except Exception as exc:  # one failing dry run is a finding: say it and go on
            print(f"{preset} {fields}: FAILED {type(exc).__name__}: {exc}"[:300])
            continue

        def attention(capture):
            return {op: n for op, n in capture.summary.by_op.items() if "ttention" in op or "oftmax" in op}

        same = "same ops" if dry.summary.by_op == real.summary.by_op else "OPS DIFFER"
        print(f"{preset} {fields}: {same}; saved bytes dry {dry.memory.saved_bytes:,} real {real.memory.saved_bytes:,}")
        print(f"    real {attention(real)}")
        print(f"    dry  {attention(dry)}")
        if dry.summary.by_op != real.summary.by_op:
            ops = set(dry.summary.by_op) | set(real.summary.by_op)
            diff = {op: (dry.summary.by_op.get(op, 0), real.summary.by_op.get(op, 0)) for op in sorted(ops)}
            print("    (dry, real) where they differ:", {op: d for op, d in diff.items() if d[0] != d[1]})


def _held_inside(op: str, x: torch.Tensor) -> float:
    """The bytes one softmax op held beyond its inputs and output, in multiples of the input's bytes."""
    aten = torch.ops.aten
    y = aten._softmax(x, -1, False)
    calls = {
        "_softmax": lambda: aten._softmax(x, -1, False),
        "_safe_softmax": lambda: aten._safe_softmax(x, -1),
        "_softmax_backward_data": lambda: aten._softmax_backward_data(x, y, -1, x.dtype),
    }
    torch.cuda.synchronize()
    with HighWater() as water:
        calls[op]()
    return held_inside(water.rows[-1]) / x.nbytes


def softmax_temporaries() -> None:
    """The bytes the GPU's softmax kernels hold beyond their inputs and output (the allocator's peak while one runs),
    by dtype and the softmax's length: a fake-tensor simulation sees only inputs and outputs."""
    for dtype in (torch.float32, torch.bfloat16):
        for n in (256, 1024, 2048, 4096, 8192):
            x = torch.randn(2**26 // n, n, device="cuda", dtype=dtype)  # 64 Mi elements
            ops = ("_softmax", "_safe_softmax", "_softmax_backward_data")
            cells = ", ".join(f"{op} {_held_inside(op, x):.3f}x" for op in ops)
            print(
                f"{str(dtype).removeprefix('torch.'):8s} length {n:5d}, {x.nbytes // 2**20} MiB in; held inside: {cells}"
            )
            del x
            torch.cuda.empty_cache()


def attention_temporaries(seq: int = 4096, heads: int = 32, kv_heads: int = 8, head_dim: int = 128) -> None:
    """One SDPA forward and backward on the GPU, op by op: each op that held bytes beyond its inputs and output."""
    q = torch.randn(1, heads, seq, head_dim, device="cuda", requires_grad=True)
    k = torch.randn(1, kv_heads, seq, head_dim, device="cuda", requires_grad=True)
    v = torch.randn(1, kv_heads, seq, head_dim, device="cuda", requires_grad=True)
    with HighWater() as water:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()
    print(f"float32 SDPA, heads {heads}/{kv_heads}, seq {seq}: ops that held bytes inside themselves")
    for row in water.rows:
        if held_inside(row):
            print(f"    {row['op']:32s} {held_inside(row) / 2**20:9.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dry-runs", action="store_true", help="meta dry runs beside real captures (needs a GPU)")
    args = parser.parse_args()
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"torch {torch.__version__} on {where}")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for heads, kv_heads in ((8, 8), (8, 2)):
            for head_dim in (64, 128):
                for mask in ("causal", "boolean"):
                    try:
                        seen = choice(args.device, dtype, heads, kv_heads, head_dim, mask)
                    except Exception as exc:  # a kernel this build lacks: say so and go on
                        seen = f"{type(exc).__name__}: {exc}"[:160]
                    label = (
                        f"{str(dtype).removeprefix('torch.'):8s} heads {heads}/{kv_heads} dim {head_dim:3d} {mask:7s}"
                    )
                    print(f"{label}  {seen}")
    if args.dry_runs:
        softmax_temporaries()
        attention_temporaries()
        dry_runs()


if __name__ == "__main__":
    main()
