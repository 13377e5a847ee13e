"""One sentence per config field that differs between two captures, each claiming only what that field explains.

Node counts are split the way the graph allows: a layer-count change owns (layers B − layers A) × nodes per layer;
the rest (nodes per layer that changed, and nodes outside the layers) belongs to the one field that can change the
graph's structure, or to the changed fields together when more than one could. Totals of bytes and FLOPs go in the
field's own sentence when it is the only change, else in one sentence for all the changes at once. When the model
changes, the fields its presets set differently come with it (one sentence); a field set apart from its side's preset
(seq 16 on bert-tiny) keeps a sentence of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphviz_core.analysis.compare_training import (
    autocast_sentence,
    compile_sentence,
    finetuning_sentence,
    optimizer_sentence,
)
from graphviz_core.capture.device import BYTES_PER
from graphviz_core.config import PRESETS, ModelConfig
from graphviz_core.units import format_bytes, format_flops

if TYPE_CHECKING:
    from graphviz_core.analysis.compare import Comparison
    from graphviz_core.capture.result import Capture

# Fields whose change leaves the graph's shape alone ("Why Your Transformer Block Has 50 Backward Nodes": the graph does not depend on sizes).
SIZE_ONLY = ("batch", "seq", "context", "seed")
# Fields that can add or remove nodes besides the layer count (the rest only resize the same ops' tensors).
STRUCTURAL = ("attention", "checkpoint", "kv_heads", "experts", "experts_per_token", "tied", "dtype", "device",
              "finetune", "lora_targets", "freeze", "autocast", "compile")
# Fields that change which parameters train (graphviz_core.models.finetune).
FINETUNING = ("finetune", "lora_rank", "lora_alpha", "lora_targets", "freeze")


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


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name != "preset"}


def starting_point(config: ModelConfig) -> dict | None:
    """Every field of the preset `config` started from: its own preset while it still names one of its family, else
    (a field was changed after the preset was picked, and the form dropped the name) the preset of its family it
    differs from in the fewest fields, the family's defaults first on a tie; None for a model with no presets."""

    def full(fields: dict) -> dict:
        return {**_FIELD_DEFAULTS, **fields}

    preset = PRESETS.get(config.preset)
    if preset is not None and full(preset.fields)["model"] == config.model:
        return full(preset.fields)
    family = config.family
    if not family.default_fields:
        return None
    given = config.to_dict()
    candidates = [full(family.default_fields), *(full(p.fields) for p in family.presets)]
    return min(candidates, key=lambda fields: sum(fields[k] != given[k] for k in fields))


def came_with_model(fa: ModelConfig, fb: ModelConfig, field: str) -> bool:
    """Whether `field` differs only because the model changed: each side holds the value of the preset it started
    from. A value set away from its own side's preset (seq 16 on bert-tiny, whose seq is 32) is a change of its own."""
    start_a, start_b = starting_point(fa), starting_point(fb)
    return all(
        start is None or start[field] == getattr(config, field) for start, config in ((start_a, fa), (start_b, fb))
    )


def _changes(fa, fb, fields: list[str]) -> str:
    return ", ".join(f"{f} {getattr(fa, f)} → {getattr(fb, f)}" for f in fields)


@dataclass
class _Scene:
    """What every field's sentence reads: the comparison, its two configs, and which fields claim the nodes."""

    c: Comparison
    split: object  # NodeSplit
    owners: list[str]
    alone: bool  # one field changed: its sentence carries the measured totals
    model_changed: bool

    def nodes_of(self, field: str) -> str:
        """What this field did to the node count, claiming only its own share."""
        if field in self.owners:
            return self.split.rest_text(self.c.b.config.layers) if len(self.owners) == 1 else "part of the node change below"
        if self.model_changed and field in STRUCTURAL:
            return "its nodes are not split from the architecture's change above"
        return "no node added or removed"


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
    model_changed = "model" in fields
    if model_changed:
        others = [f for f in fields if f != "model"]
        with_model = [f for f in others if came_with_model(fa, fb, f)]
        fields = [f for f in others if f not in with_model]  # set apart from the presets: each has its own sentence
        yield _model_sentence(c, totals, with_model, fields)
        if not fields:
            return
    split = split_nodes(c)
    alone = len(fields) == 1 and not model_changed  # else the totals are stated once, not in one field's sentence
    layer_free = [f for f in fields if f != "layers"]
    if split.rest and not model_changed:  # the architecture owns every node when it changed
        owners = [f for f in layer_free if f in STRUCTURAL] or layer_free
    else:
        owners = []
    scene = _Scene(c, split, owners, alone, model_changed)
    for field in fields:
        yield _field_sentence(scene, field, getattr(fa, field), getattr(fb, field))
    if len(owners) > 1:
        yield (
            f"The {split.rest_text(fb.layers)}"
            + (" not explained by the layer count" if "layers" in fields else "")
            + " come from "
            f"{_changes(fa, fb, owners)} together; one pair of graphs cannot split them between these fields."
        )
    if not alone and not model_changed:  # a model change gave the totals in its own sentence
        yield f"All {len(fields)} changes together: {totals}."



def _model_sentence(c: Comparison, totals: str, with_model: list[str], fields: list[str]) -> str:
    a, b, fa, fb = c.a, c.b, c.a.config, c.b.config
    return (
        f"model {fa.model} → {fb.model}: a different architecture, so every number differs at once: "
        f"{b.summary.nodes - a.summary.nodes:+d} nodes ({_op_summary(c)}); {totals}."
        + (
            f" Also changed: {_changes(fa, fb, with_model)}; these come with the other architecture, and the "
            "totals above are not split among them."
            if with_model
            else ""
        )
        + (
            f" Not from the architecture: {_changes(fa, fb, fields)}, set apart from the presets' values"
            + (" (each has its own sentence below)" if len(fields) > 1 else " (its own sentence follows)")
            + "; the totals above include "
            + ("them." if len(fields) > 1 else "it.")
            if fields
            else ""
        )
    )


def _field_sentence(scene: _Scene, field: str, va, vb) -> str:
    """The sentence for one changed field."""
    c, split, owners, alone = scene.c, scene.split, scene.owners, scene.alone
    a, b, fa, fb = c.a, c.b, c.a.config, c.b.config
    nodes_of = scene.nodes_of
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
        return (
            f"{vb} attention instead of {va} {keeps}: {nodes_of(field)}{ops}; s×s tensors saved "
            f"for backward {format_bytes(sa)} → {format_bytes(sb)}. "
            + (
                "A fused kernel keeps only its output and log-sum-exp and recomputes q·kᵀ in backward."
                if {"manual", "eager"} & {va, vb}
                else "Both run a fused kernel; the wrapper's ops differ."
            )
        )
    elif field == "checkpoint":
        return (
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
        return (
            f"{vb} instead of {va}: {BYTES_PER[vb]} bytes per element instead of "
            f"{BYTES_PER[va]}, for every saved tensor and parameter{measured}; {nodes_of(field)}."
        )
    elif field in SIZE_ONLY:
        return _size_only_sentence(scene, field, va, vb)
    elif field in FINETUNING:
        return finetuning_sentence(c, field, nodes_of(field), va, vb)
    elif field == "autocast":
        return autocast_sentence(c, nodes_of(field), alone, va, vb)
    elif field == "compile":
        return compile_sentence(c, nodes_of(field), alone, va, vb)
    elif field == "optimizer":
        return optimizer_sentence(c, nodes_of(field), va, vb)
    elif field == "device":
        return (
            f"device {va} → {vb} (ran on {a.device} and {b.device}): {nodes_of(field)}; "
            + (
                "meta runs shapes only, so time and gradient norms are absent there."
                if "meta" in (a.device, b.device)
                else "the same ops, timed on different hardware."
            )
        )
    elif field == "layers":
        return _layers_sentence(scene, va, vb)
    elif field in ("hidden", "heads", "vocab", "intermediate", "kv_heads", "context", "image_size"):
        why = _size_reason(field, fa, fb)
        measured = (
            f"; parameters {a.summary.parameter_count:,} → {b.summary.parameter_count:,}, backward FLOPs "
            f"{_ratio(a.flops.backward, b.flops.backward)}"
            if alone
            else ""
        )
        return f"{field} {va} → {vb}: {nodes_of(field)}{measured} ({why})."
    else:
        return f"{field} {va} → {vb}: {nodes_of(field)}."


def _size_only_sentence(scene: _Scene, field: str, va, vb) -> str:
    """batch, seq, context or seed: the graph's shape stays; the work scales."""
    c, owners, alone, nodes_of = scene.c, scene.owners, scene.alone, scene.nodes_of
    a, b = c.a, c.b
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
    return f"{field} {va} → {vb}: {shape}{scale}"


def _layers_sentence(scene: _Scene, va, vb) -> str:
    """A layer count: per-layer nodes where the layers are alike."""
    c, split, alone = scene.c, scene.split, scene.alone
    a, b, fa = c.a, c.b, c.a.config
    family = c.b.config.model
    if scene.model_changed:
        return (
            f"{vb} layers instead of {va}: each of {family}'s layers repeats the same ops, but they are not "
            f"{fa.model}'s layers, so the node change is not split per layer (the architecture's sentence above "
            "has it)."
        )
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
    return f"{vb} layers instead of {va}: {nodes}{grows}"


def _size_reason(field: str, fa, fb) -> str:
    """Why a width field moves bytes and FLOPs, in the words of B's family (no GELU for Llama)."""
    family = fb.family
    if field == "hidden":
        return f"the same ops on wider tensors: {family.hidden_grows}"
    if field == "heads":
        return (
            f"head size hidden / heads {fa.hidden // fa.heads} → {fb.hidden // fb.heads}: each head runs the same "
            "ops, and the s×s attention scores grow with the head count"
        )
    if field == "kv_heads":
        return "grouped-query attention: fewer key-value heads shrink the k and v projections and the saved k, v"
    if field == "intermediate":
        return f"the same ops on wider tensors: the {family.mlp_matmuls} grow with it"
    if field == "vocab":
        return "the same ops on wider tensors: the embedding, the lm_head matmul and the loss grow with the vocabulary"
    if field == "context":
        return "more position-embedding rows: a bigger parameter, the same ops"
    return "the same ops on bigger images"
