"""One sentence per config field that differs between two captures: what it changed, measured, and why."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from graphviz_core.ui.format import format_bytes, format_flops  # pure formatting, no Streamlit

if TYPE_CHECKING:
    from graphviz_core.capture import Capture
    from graphviz_core.compare import Comparison

# Fields whose change leaves the graph's shape alone (seed 000: the graph does not depend on sizes).
SIZE_ONLY = ("batch", "seq", "context", "seed")


def _square_saved_bytes(capture: Capture) -> int:
    """Bytes saved for backward in tensors whose last two dims are seq x seq: the attention probabilities."""
    s = capture.config.seq
    total = 0
    for event in capture.save_order:
        if event.counted and len(event.shape) >= 2 and event.shape[-2:] == (s, s) and s > 1:
            total += event.storage_bytes
    return total


def _ratio(a: float, b: float) -> str:
    if not a:
        return "from 0"
    return f"×{b / a:.2f}"


def _op_summary(comparison: Comparison, limit: int = 6) -> str:
    parts = [f"{c.delta:+d} {c.name.removesuffix('Backward0')}" for c in comparison.by_op[:limit]]
    more = len(comparison.by_op) - limit
    return ", ".join(parts) + (f", and {more} more ops" if more > 0 else "")


def explain(c: Comparison) -> list[str]:
    return list(_sentences(c))


def _sentences(c: Comparison) -> Iterator[str]:
    a, b = c.a, c.b
    fa, fb = a.config, b.config
    fields = [k for k, v in fa.to_dict().items() if k != "preset" and v != fb.to_dict().get(k)]
    nodes_delta = b.summary.nodes - a.summary.nodes
    per_layer = c.nodes_per_layer_delta
    node_text = (
        f"{per_layer:+d} nodes per layer ({nodes_delta:+d} in all)"
        if per_layer and fa.layers == fb.layers
        else f"{nodes_delta:+d} nodes"
    )
    if not fields:
        yield "The two configs are identical: the same graph, node for node."
        return
    for field in fields:
        va, vb = getattr(fa, field), getattr(fb, field)
        if field == "attention":
            sa, sb = _square_saved_bytes(a), _square_saved_bytes(b)
            keeps = (
                "keeps the s×s probabilities"
                if sb > sa
                else "drops the s×s probabilities"
                if sa > sb
                else "keeps no extra s×s tensors"
            )
            yield (
                f"{vb} attention instead of {va} {keeps}: {node_text} ({_op_summary(c)}); s×s tensors saved "
                f"for backward {format_bytes(sa)} → {format_bytes(sb)}. "
                + (
                    "A fused kernel keeps only its output and log-sum-exp and recomputes q·kᵀ in backward."
                    if "manual" in (va, vb)
                    else "Both run a fused kernel; the wrapper's ops differ."
                )
            )
        elif field == "checkpoint":
            yield (
                f"checkpointing {va} → {vb}: saved for backward {format_bytes(a.memory.saved_bytes)} → "
                f"{format_bytes(b.memory.saved_bytes)}, inputs held for recompute "
                f"{format_bytes(a.memory.checkpoint_held_bytes)} → {format_bytes(b.memory.checkpoint_held_bytes)}; "
                f"backward re-runs forward work: recompute {format_flops(a.flops.backward_recompute)} → "
                f"{format_flops(b.flops.backward_recompute)}. Checkpointed regions keep only their inputs and "
                "rebuild the rest when backward reaches them."
            )
        elif field == "dtype":
            yield (
                f"{vb} instead of {va}: saved for backward {format_bytes(a.memory.saved_bytes)} → "
                f"{format_bytes(b.memory.saved_bytes)} ({_ratio(a.memory.saved_bytes, b.memory.saved_bytes)}), "
                f"parameters {format_bytes(a.memory.parameter_bytes)} → {format_bytes(b.memory.parameter_bytes)}: "
                f"bytes per element change; FLOPs count arithmetic, not bytes, so backward stays "
                f"{format_flops(a.flops.backward)} → {format_flops(b.flops.backward)}; {node_text}."
            )
        elif field in SIZE_ONLY:
            yield (
                f"{field} {va} → {vb}: {node_text} — the graph's shape does not depend on {field}; the work "
                f"scales instead: saved for backward {_ratio(a.memory.saved_bytes, b.memory.saved_bytes)}, "
                f"backward FLOPs {_ratio(a.flops.backward, b.flops.backward)}"
                + (" (attention grows as seq², the rest as seq)." if field == "seq" else ".")
            )
        elif field == "device":
            yield (
                f"device {va} → {vb} (ran on {a.device} and {b.device}): {node_text}; "
                + (
                    "meta runs shapes only, so time and gradient norms are absent there."
                    if "meta" in (a.device, b.device)
                    else "the same ops, timed on different hardware."
                )
            )
        elif field == "layers":
            yield (
                f"{vb} layers instead of {va}: {node_text}; each layer repeats the same nodes, so counts, "
                f"saved bytes ({_ratio(a.memory.saved_bytes, b.memory.saved_bytes)}) and FLOPs "
                f"({_ratio(a.flops.backward, b.flops.backward)}) grow with the layer count, plus the fixed "
                "embedding, head and loss."
            )
        elif field in ("hidden", "heads", "vocab"):
            yield (
                f"{field} {va} → {vb}: {node_text}; parameters {a.summary.parameter_count:,} → "
                f"{b.summary.parameter_count:,}; backward FLOPs {_ratio(a.flops.backward, b.flops.backward)} "
                + (
                    "(matmuls grow as hidden², GELU/LayerNorm as hidden)."
                    if field == "hidden"
                    else "(head count splits the same width; the s×s attention work grows with it)."
                    if field == "heads"
                    else "(the lm_head matmul and the loss grow with the vocabulary)."
                )
            )
        else:
            yield (
                f"{field} {va} → {vb}: a different model, {node_text} ({_op_summary(c)}); parameters "
                f"{a.summary.parameter_count:,} → {b.summary.parameter_count:,}, backward FLOPs "
                f"{format_flops(a.flops.backward)} → {format_flops(b.flops.backward)}."
            )
