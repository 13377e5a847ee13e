"""One sentence per config field that differs between two captures, each claiming only what that field explains.

Node counts are split the way the graph allows: a layer-count change owns (layers B − layers A) × nodes per layer;
the rest (nodes per layer that changed, and nodes outside the layers) belongs to the one field that can change the
graph's structure, or to the changed fields together when more than one could. Totals of bytes and FLOPs go in the
field's own sentence when it is the only change, else in one sentence for all the changes at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphviz_core.config import ROPE_FAMILIES
from graphviz_core.device import BYTES_PER
from graphviz_core.units import format_bytes, format_flops

if TYPE_CHECKING:
    from graphviz_core.capture import Capture
    from graphviz_core.compare import Comparison

# Fields whose change leaves the graph's shape alone (seed 000: the graph does not depend on sizes).
SIZE_ONLY = ("batch", "seq", "context", "seed")
# Fields that can add or remove nodes besides the layer count (the rest only resize the same ops' tensors).
STRUCTURAL = ("attention", "checkpoint", "kv_heads", "experts", "experts_per_token", "tied", "dtype", "device")


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


def _plural(n: int, word: str) -> str:
    return f"{n:+d} {word}" if abs(n) == 1 else f"{n:+d} {word}s"


@dataclass(frozen=True)
class NodeSplit:
    """B − A nodes, split into what the layer count explains and what is left for the other fields."""

    total: int
    from_layers: int | None  # (layers B − layers A) × nodes per layer of A; None when layers differ in size
    per_layer_a: int | None  # nodes in each numbered layer of A, when every one has the same count
    per_layer_change: int  # nodes per layer B − A (0 unless both are uniform and differ)
    rest: int  # total − from_layers: nodes the other changed fields own

    def rest_text(self, layers_b: int) -> str:
        if self.per_layer_change and self.rest == self.per_layer_change * layers_b:
            return f"{self.per_layer_change:+d} nodes per layer ({self.rest:+d} in all)"
        return f"{self.rest:+d} nodes"


def _uniform(counts: list[int]) -> int | None:
    distinct = set(counts)
    return distinct.pop() if len(distinct) == 1 else None


def split_nodes(c: Comparison) -> NodeSplit:
    numbered = [p for p in c.per_layer if any(part.isdigit() for part in p.layer.split("."))]
    n_a = _uniform([p.a_nodes for p in numbered if p.a_nodes])
    n_b = _uniform([p.b_nodes for p in numbered if p.b_nodes])
    total = c.b.summary.nodes - c.a.summary.nodes
    delta_layers = c.b.config.layers - c.a.config.layers
    if not delta_layers:
        from_layers = 0
    else:
        from_layers = delta_layers * n_a if n_a is not None else None
    per_layer_change = n_b - n_a if n_a is not None and n_b is not None else 0
    rest = total - from_layers if from_layers is not None else 0
    return NodeSplit(total, from_layers, n_a, per_layer_change, rest)


def explain(c: Comparison) -> list[str]:
    return list(_sentences(c))


def _changes(fa, fb, fields: list[str]) -> str:
    return ", ".join(f"{f} {getattr(fa, f)} → {getattr(fb, f)}" for f in fields)


def _sentences(c: Comparison) -> Iterator[str]:
    a, b = c.a, c.b
    fa, fb = a.config, b.config
    fields = [k for k, v in fa.to_dict().items() if k != "preset" and v != fb.to_dict().get(k)]
    if not fields:
        yield "The two configs are identical: the same graph, node for node."
        return
    totals = (
        f"parameters {a.summary.parameter_count:,} → {b.summary.parameter_count:,}, saved for backward "
        f"{format_bytes(a.memory.saved_bytes)} → {format_bytes(b.memory.saved_bytes)} "
        f"({_ratio(a.memory.saved_bytes, b.memory.saved_bytes)}), backward FLOPs {format_flops(a.flops.backward)} → "
        f"{format_flops(b.flops.backward)} ({_ratio(a.flops.backward, b.flops.backward)})"
    )
    if "model" in fields:
        others = [f for f in fields if f != "model"]
        yield (
            f"model {fa.model} → {fb.model}: a different architecture, so every number differs at once: "
            f"{b.summary.nodes - a.summary.nodes:+d} nodes ({_op_summary(c)}); {totals}."
            + (
                f" Also changed: {_changes(fa, fb, others)}; these come with the other architecture, and the "
                "totals above are not split among them."
                if others
                else ""
            )
        )
        return
    split = split_nodes(c)
    alone = len(fields) == 1
    layer_free = [f for f in fields if f != "layers"]
    if split.rest:
        owners = [f for f in layer_free if f in STRUCTURAL] or layer_free
    else:
        owners = []

    def nodes_of(field: str) -> str:
        """What this field did to the node count, claiming only its own share."""
        if field in owners:
            return split.rest_text(fb.layers) if len(owners) == 1 else "part of the node change below"
        return "no node added or removed"

    family = fb.model
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
            ops = f" ({_op_summary(c)})" if split.total == split.rest and len(owners) == 1 else ""
            yield (
                f"{vb} attention instead of {va} {keeps}: {nodes_of(field)}{ops}; s×s tensors saved "
                f"for backward {format_bytes(sa)} → {format_bytes(sb)}. "
                + (
                    "A fused kernel keeps only its output and log-sum-exp and recomputes q·kᵀ in backward."
                    if {"manual", "eager"} & {va, vb}
                    else "Both run a fused kernel; the wrapper's ops differ."
                )
            )
        elif field == "checkpoint":
            yield (
                f"checkpointing {va} → {vb}: {nodes_of(field)}; saved for backward {format_bytes(a.memory.saved_bytes)} → "
                f"{format_bytes(b.memory.saved_bytes)}, inputs held for recompute "
                f"{format_bytes(a.memory.checkpoint_held_bytes)} → {format_bytes(b.memory.checkpoint_held_bytes)}; "
                f"backward re-runs forward work: recompute {format_flops(a.flops.backward_recompute)} → "
                f"{format_flops(b.flops.backward_recompute)}. Checkpointed regions keep only their inputs and "
                "rebuild the rest when backward reaches them."
            )
        elif field == "dtype":
            measured = (
                f": saved for backward {format_bytes(a.memory.saved_bytes)} → {format_bytes(b.memory.saved_bytes)} "
                f"({_ratio(a.memory.saved_bytes, b.memory.saved_bytes)}), parameters "
                f"{format_bytes(a.memory.parameter_bytes)} → {format_bytes(b.memory.parameter_bytes)}; FLOPs count "
                f"arithmetic, not bytes, so backward stays {format_flops(a.flops.backward)} → "
                f"{format_flops(b.flops.backward)}"
                if alone
                else "; FLOPs count arithmetic, not bytes, so it changes no FLOP count"
            )
            yield (
                f"{vb} instead of {va}: {BYTES_PER[vb]} bytes per element instead of "
                f"{BYTES_PER[va]}, for every saved tensor and parameter{measured}; {nodes_of(field)}."
            )
        elif field in SIZE_ONLY:
            if field in owners:
                shape = (
                    f"{nodes_of(field)}: at a size of 1 some ops take a different path (broadcasts, squeezes)"
                    if 1 in (va, vb) and len(owners) == 1
                    else nodes_of(field)
                )
            else:
                shape = f"{nodes_of(field)} — the graph's shape does not depend on {field}"
            scale = (
                f"; the work scales instead: saved for backward {_ratio(a.memory.saved_bytes, b.memory.saved_bytes)}, "
                f"backward FLOPs {_ratio(a.flops.backward, b.flops.backward)}"
                + (" (attention grows as seq², the rest as seq)." if field == "seq" else ".")
                if alone
                else (
                    "; the activations saved for backward and the FLOPs scale with it."
                    if field in ("batch", "seq")
                    else "."
                )
            )
            yield f"{field} {va} → {vb}: {shape}{scale}"
        elif field == "device":
            yield (
                f"device {va} → {vb} (ran on {a.device} and {b.device}): {nodes_of(field)}; "
                + (
                    "meta runs shapes only, so time and gradient norms are absent there."
                    if "meta" in (a.device, b.device)
                    else "the same ops, timed on different hardware."
                )
            )
        elif field == "layers":
            delta = vb - va
            if split.from_layers is None:
                nodes = f"the layers differ in size, so the {split.total:+d} nodes in all are not split per layer"
            else:
                nodes = (
                    f"{_plural(delta, 'layer')} × {split.per_layer_a} nodes per layer = {split.from_layers:+d} nodes"
                    + (", all of the node difference" if split.from_layers == split.total else "")
                )
            grows = (
                f"; counts, saved bytes ({_ratio(a.memory.saved_bytes, b.memory.saved_bytes)}) and FLOPs "
                f"({_ratio(a.flops.backward, b.flops.backward)}) grow with the layer count, plus the fixed "
                "embedding, head and loss."
                if alone
                else "; each layer repeats the same ops."
            )
            yield f"{vb} layers instead of {va}: {nodes}{grows}"
        elif field in ("hidden", "heads", "vocab", "intermediate", "kv_heads", "context", "image_size"):
            why = _size_reason(field, fa, fb, family)
            measured = (
                f"; parameters {a.summary.parameter_count:,} → {b.summary.parameter_count:,}, backward FLOPs "
                f"{_ratio(a.flops.backward, b.flops.backward)}"
                if alone
                else ""
            )
            yield f"{field} {va} → {vb}: {nodes_of(field)}{measured} ({why})."
        else:
            yield f"{field} {va} → {vb}: {nodes_of(field)}."
    if len(owners) > 1:
        yield (
            f"The {split.rest_text(fb.layers)}"
            + (" not explained by the layer count" if "layers" in fields else "")
            + " come from "
            f"{_changes(fa, fb, owners)} together; one pair of graphs cannot split them between these fields."
        )
    if not alone:
        yield f"All {len(fields)} changes together: {totals}."


def _size_reason(field: str, fa, fb, family: str) -> str:
    """Why a width field moves bytes and FLOPs, in the words of the family (no GELU for Llama)."""
    rope = family in ROPE_FAMILIES
    if field == "hidden":
        if rope:
            return (
                "the same ops on wider tensors: the attention and SwiGLU projections grow as hidden × (hidden or "
                "intermediate), RMSNorm, rotary and residual adds as hidden"
            )
        if family in ("gpt2", "block", "gpt2-hf"):
            return "the same ops on wider tensors: matmuls grow as hidden², GELU and LayerNorm as hidden"
        return "the same ops on wider tensors: matmuls grow as hidden², elementwise work as hidden"
    if field == "heads":
        return (
            f"head size hidden / heads {fa.hidden // fa.heads} → {fb.hidden // fb.heads}: each head runs the same "
            "ops, and the s×s attention scores grow with the head count"
        )
    if field == "kv_heads":
        return "grouped-query attention: fewer key-value heads shrink the k and v projections and the saved k, v"
    if field == "intermediate":
        mlp = "SwiGLU MLP's three matmuls" if rope else "MLP's two matmuls"
        return f"the same ops on wider tensors: the {mlp} grow with it"
    if field == "vocab":
        return "the same ops on wider tensors: the embedding, the lm_head matmul and the loss grow with the vocabulary"
    if field == "context":
        return "more position-embedding rows: a bigger parameter, the same ops"
    return "the same ops on bigger images"
