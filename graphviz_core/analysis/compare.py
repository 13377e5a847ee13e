"""The difference between two captures: headline deltas, a node-by-node graph diff, per-layer totals, and
one sentence per config field that differs saying what it changed and why.

Nodes are matched by (module, op, position), where position is the node's rank among the nodes of the same
module and op in the capture's deterministic numbering, so inserting ops elsewhere does not shift a match.
"""

from __future__ import annotations

import dataclasses
import gc
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from difflib import SequenceMatcher

from graphviz_core.analysis.flop_analysis import LOSS_AND_GLUE, layer_of, layers_in_forward_order, node_parts
from graphviz_core.capture.result import Capture

Key = tuple[str, str, int]


@dataclass(frozen=True)
class Headline:
    name: str
    unit: str  # "nodes", "bytes", "FLOP", "s", "scalars"
    a: float | None
    b: float | None

    @property
    def delta(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a


@dataclass(frozen=True)
class CountDelta:
    name: str  # an op or a module
    a_nodes: int
    b_nodes: int

    @property
    def delta(self) -> int:
        return self.b_nodes - self.a_nodes


@dataclass(frozen=True)
class LayerPair:
    layer: str
    a_saved_bytes: int
    b_saved_bytes: int
    a_flop: int  # forward + backward
    b_flop: int
    a_nodes: int
    b_nodes: int


@dataclass(frozen=True)
class ChangedNode:
    a_node: str
    b_node: str
    fields: tuple[str, ...]  # which of saved_bytes / flops differ


@dataclass(frozen=True)
class Comparison:
    a: Capture
    b: Capture
    headline: tuple[Headline, ...]
    by_op: tuple[CountDelta, ...]  # only ops whose count differs
    by_module: tuple[CountDelta, ...]  # only modules whose count differs
    per_layer: tuple[LayerPair, ...]  # in forward order: embeddings, layers 0..N-1, final norm, head, the loss last
    only_a: frozenset[str]
    only_b: frozenset[str]
    changed: tuple[ChangedNode, ...]
    nodes_per_layer_delta: int | None  # when every numbered layer changed by the same count
    explanations: tuple[str, ...]

    def to_dict(self) -> dict:
        return {
            "schema": 1,
            "a": {"config": self.a.config.to_dict(), "device": self.a.device},
            "b": {"config": self.b.config.to_dict(), "device": self.b.device},
            "differing_fields": differing_fields(self.a, self.b),
            "headline": [{"name": h.name, "unit": h.unit, "a": h.a, "b": h.b, "delta": h.delta} for h in self.headline],
            "nodes_per_layer_delta": self.nodes_per_layer_delta,
            "by_op": [{"op": c.name, "a": c.a_nodes, "b": c.b_nodes, "delta": c.delta} for c in self.by_op],
            "by_module": [{"module": c.name, "a": c.a_nodes, "b": c.b_nodes, "delta": c.delta} for c in self.by_module],
            "per_layer": [dataclasses.asdict(p) for p in self.per_layer],
            "only_a": sorted(self.only_a, key=_number),
            "only_b": sorted(self.only_b, key=_number),
            "changed": [dataclasses.asdict(c) for c in self.changed],
            "explanations": list(self.explanations),
        }


def _number(node: str) -> int:
    return int(node.rpartition(":")[2])


@dataclass(frozen=True)
class _Tally:
    """What the diff needs from one capture, gathered in one pass over its nodes."""

    keys: dict[Key, str]  # (module, op, position) -> node id, in the capture's numbering (loss first)
    ops: Counter[str]
    modules: Counter[str]
    layers: dict[str, list[int]]  # layer -> [saved bytes, forward + backward FLOPs, nodes]


def _tally(capture: Capture) -> _Tally:
    nodes = sorted(capture.graph.nodes(data=True), key=lambda item: _number(item[0]))  # already in order: O(n)
    seen: Counter[tuple[str, str]] = Counter()
    keys: dict[Key, str] = {}
    modules: Counter[str] = Counter()
    layers: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for node, d in nodes:
        module, op = d["module"], d["op"]
        pair = (module, op)
        keys[(module, op, seen[pair])] = node
        seen[pair] += 1
        modules[module] += 1
        layers[layer_of(module)][2] += 1
        for part, _, saved_bytes, flops in node_parts(node, d):  # a compiled region's node: by module
            row = layers[layer_of(part)]
            row[0] += saved_bytes
            row[1] += flops
    ops: Counter[str] = Counter()
    for (_, op), n in seen.items():
        ops[op] += n
    for module, flops in capture.flops.forward_by_module.items():
        layers[layer_of(module)][1] += flops
    return _Tally(keys, ops, modules, layers)


def differing_fields(a: Capture, b: Capture) -> dict[str, list]:
    """The config fields whose values differ, as [A's, B's]; a field only one side's family has reads None on the other."""
    ca, cb = a.config.shown(), b.config.shown()
    keys = [*ca, *(k for k in cb if k not in ca)]
    return {k: [ca.get(k), cb.get(k)] for k in keys if ca.get(k) != cb.get(k) and k != "preset"}


def _count_deltas(a: Counter, b: Counter) -> tuple[CountDelta, ...]:
    names = sorted(set(a) | set(b), key=lambda n: (-abs(b[n] - a[n]), n))
    return tuple(CountDelta(n, a[n], b[n]) for n in names if a[n] != b[n])


def _layer_order(name: str) -> tuple:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))


def _forward_order(a: Capture, b: Capture, names: set[str]) -> list[str]:
    """`names` (the layers of A and B) in the order the forward ran them, as the Memory and FLOPs tabs list one
    capture's layers. A's and B's orders are merged: a layer both have keeps its place, a run of layers only one side
    has (8B's 32 layers against 70B's 80: model.layers.32-79) sits where that side ran it, and where each side has a
    run of its own at the same place (GPT-2's blocks against Llama's layers) A's run comes first. Layers with forward
    FLOPs and no node of the graph (rotary tables, mask bookkeeping) come after the others and before the loss, as
    the FLOPs tab places them."""
    order_a, order_b = layers_in_forward_order(a), layers_in_forward_order(b)
    merged: list[str] = []
    matcher = SequenceMatcher(None, order_a, order_b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        merged += order_a[i1:i2]
        if tag != "equal":
            merged += order_b[j1:j2]
    ran = [name for name in dict.fromkeys(merged) if name in names and name != LOSS_AND_GLUE]
    forward_only = sorted(names - set(ran) - {LOSS_AND_GLUE}, key=_layer_order)
    return ran + forward_only + ([LOSS_AND_GLUE] if LOSS_AND_GLUE in names else [])


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cycle collector while the diff builds its short-lived, acyclic tables. Two 70B captures keep
    ~10^5 objects alive; the ~10^4 tuples a diff allocates pushed the collector into full passes over all of them
    (0.16-0.39 s measured, against 0.05 s for the diff itself); paused, the tables die by reference counting."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def compare_captures(a: Capture, b: Capture) -> Comparison:
    """Everything that differs between two captures (A is the reference, deltas are B − A)."""
    with _collector_paused():
        return _compare(a, b)


def _compare(a: Capture, b: Capture) -> Comparison:
    tally_a, tally_b = _tally(a), _tally(b)
    keys_a, keys_b = tally_a.keys, tally_b.keys
    nodes_a, nodes_b = a.graph.nodes, b.graph.nodes
    only_b = frozenset(node for key, node in keys_b.items() if key not in keys_a)
    gone, changed = [], []
    for key, node_a in keys_a.items():  # A's numbering order, one dict look-up per node
        node_b = keys_b.get(key)
        if node_b is None:
            gone.append(node_a)
            continue
        da, db = nodes_a[node_a], nodes_b[node_b]
        fields = tuple(f for f in ("saved_bytes", "flops") if da[f] != db[f])
        if fields:
            changed.append(ChangedNode(node_a, node_b, fields))
    only_a = frozenset(gone)

    ops_a, ops_b, mods_a, mods_b = tally_a.ops, tally_b.ops, tally_a.modules, tally_b.modules
    layers_a, layers_b = tally_a.layers, tally_b.layers
    zero = [0, 0, 0]
    per_layer = tuple(
        LayerPair(
            name, *(x for pair in zip(layers_a.get(name, zero), layers_b.get(name, zero), strict=True) for x in pair)
        )
        for name in _forward_order(a, b, set(layers_a) | set(layers_b))
    )
    numbered = [p for p in per_layer if any(part.isdigit() for part in p.layer.split("."))]
    deltas = {p.b_nodes - p.a_nodes for p in numbered if p.a_nodes and p.b_nodes}
    per_layer_delta = deltas.pop() if len(deltas) == 1 else None

    def time_total(c: Capture) -> float | None:
        return None if c.time.backward_s is None else c.time.forward_s + c.time.backward_s

    headline = (
        Headline("Nodes", "nodes", a.summary.nodes, b.summary.nodes),
        Headline("Edges", "edges", a.summary.edges, b.summary.edges),
        Headline("Parameters", "scalars", a.summary.parameter_count, b.summary.parameter_count),
        Headline("Saved for backward", "bytes", a.memory.saved_bytes, b.memory.saved_bytes),
        Headline("Peak memory", "bytes", a.memory.peak_bytes, b.memory.peak_bytes),
        Headline("Forward FLOPs", "FLOP", a.flops.forward, b.flops.forward),
        Headline("Backward FLOPs", "FLOP", a.flops.backward, b.flops.backward),
        Headline("Forward + backward time", "s", time_total(a), time_total(b)),
    )
    comparison = Comparison(
        a,
        b,
        headline,
        _count_deltas(ops_a, ops_b),
        _count_deltas(mods_a, mods_b),
        per_layer,
        only_a,
        only_b,
        tuple(changed),
        per_layer_delta,
        (),
    )
    from graphviz_core.analysis.compare_reasons import explain  # the sentences read the finished comparison

    return dataclasses.replace(comparison, explanations=tuple(explain(comparison)))
