"""A compiled region's backward FX graph (a CompiledFunctionBackward node's `compiled` field) as a graph in the schema
the renderer draws: one node per FX node, edges from each input to the node that reads it (the way data flows)."""

from __future__ import annotations

import networkx as nx

from graphviz_core.units import format_bytes

ROLE_WORDS = {
    "saved": "saved by the compiled forward for this backward",
    "tangent": "the gradient coming in",
    "recomputed": "a forward op computed again here (not saved)",
    "gradient": "computes gradients",
    "output": "the gradients this backward returns",
}


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
        graph.add_node(node["name"], op=node["op"], category=node["category"], module="", label=label,
                       saved_bytes=node["bytes"] if node["role"] == "saved" else 0, flops=0, time_s=None,
                       grad_norm=None, details=details, role=node["role"])
    graph.add_edges_from((source, target) for source, target in opened["edges"])
    return graph
