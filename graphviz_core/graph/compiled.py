"""A compiled region's backward FX graph (a CompiledFunctionBackward node's `compiled` field) as a graph in the schema
the renderer draws: one node per FX node, edges from each input to the node that reads it (the way data flows)."""

from __future__ import annotations

import networkx as nx

from graphviz_core.graph.layout import Layout, layered_layout
from graphviz_core.units import format_bytes

ROLE_WORDS = {
    "saved": "saved by the compiled forward for this backward",
    "tangent": "the gradient coming in",
    "recomputed": "a forward op computed again here (not saved)",
    "gradient": "computes gradients",
    "output": "the gradients this backward returns",
}


# The FX graph's inputs and output by what they are (export.formats colours them; saved tensors are ovals), and the
# legend's words for them: under `other` the saved tensors were missing from the legend, black boxes like any op.
ROLE_CATEGORIES = {"saved": "saved_tensor", "tangent": "incoming_gradient", "output": "returned_gradients"}
LEGEND = {"saved_tensor": "saved by the forward", "incoming_gradient": "incoming gradient",
          "returned_gradients": "returned gradients"}


def fx_layout(graph: nx.DiGraph, widths: dict[str, float] | None = None) -> Layout:
    """The layered layout with each saved tensor one layer above the first op that reads it. Laid out as sources, all
    of them (45 in gpt2-tiny's region) made the top row, thousands of px wide, their edges running pages down to their
    readers: the first view showed a few ovals and edges off the pane. Extra edges, used only to lay the graph out,
    hang each saved tensor below a node two layers above its first reader."""
    generation = {n: d for d, layer in enumerate(nx.topological_generations(graph)) for n in layer}
    by_depth: dict[int, str] = {}
    for node, depth in generation.items():
        by_depth.setdefault(depth, node)
    placed = graph.copy()
    for node, data in graph.nodes(data=True):
        readers = [generation[r] for r in graph.successors(node)]
        if data["role"] == "saved" and readers and min(readers) >= 2:
            placed.add_edge(by_depth[min(readers) - 2], node)
    return layered_layout(placed, widths=widths)


def start_node(graph: nx.DiGraph) -> str | None:
    """Where backward starts in the FX graph: its (first) incoming gradient."""
    return next((n for n, d in graph.nodes(data=True) if d["role"] == "tangent"), None)


def fx_backward_graph(opened: dict) -> nx.DiGraph:
    """The opened region's backward FX graph: each node labelled by its FX name and op, coloured by the category its
    aten op has in autograd's graph (placeholders and the output: `other`), with its own details rows."""
    graph = nx.DiGraph()
    for node in opened["nodes"]:
        shape = "" if node["shape"] is None else f"{tuple(node['shape'])} {node['dtype']}"
        label = node["name"] if node["kind"] != "call_function" else f"{node['op']}\n{node['name']}"
        details = [["FX node", node["name"]], ["op", node["target"]], ["role", ROLE_WORDS.get(node["role"], node["role"])]]
        if shape:
            details.append(["tensor", f"{shape}, {format_bytes(node['bytes'])}"])
        if node["role"] == "saved" and node.get("parameter"):
            details.append(["  note", "a parameter: held anyway, not counted as saved"])
        details.append(["inputs", ", ".join(node["inputs"]) or "(none)"])
        category = ROLE_CATEGORIES.get(node["role"], node["category"])
        graph.add_node(node["name"], op=node["op"], category=category, module="", label=label,
                       saved_bytes=node["bytes"] if node["role"] == "saved" else 0, flops=0, time_s=None,
                       grad_norm=None, details=details, role=node["role"])
    graph.add_edges_from((source, target) for source, target in opened["edges"])
    return graph
