"""Writes a Capture in the formats DESIGN.md promises: JSON (the contract), GraphML, DOT and SVG.

HTML lives in `graphviz_core.render`, which is allowed to use pyvis.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess

import networkx as nx

from graphviz_core.capture import Capture
from graphviz_core.training_step import memory_details

SCHEMA_VERSION = 1
FORMATS = ("json", "html", "graphml", "dot", "svg")

# Fill colours per category, shared by DOT/SVG and the interactive view (colour-blind-safe where possible).
CATEGORY_COLOURS = {
    "attention": "#d62728",
    "matmul": "#1f77b4",
    "normalization": "#9467bd",
    "activation": "#ff7f0e",
    "elementwise": "#bcbd22",
    "residual_add": "#2ca02c",
    "reduction": "#8c564b",
    "loss": "#e377c2",
    "embedding": "#17becf",
    "shape": "#c7c7c7",
    "conversion": "#7f7f7f",
    "checkpoint": "#393b79",
    "accumulate_grad": "#ffdd57",
    "conv": "#6baed6",
    "position": "#f7b6d2",
    "routing": "#dbdb8d",
    "pooling": "#9edae5",
    "communication": "#ad494a",
    "other": "#000000",
}


def _finite(value: object) -> object:
    """JSON has no NaN/inf: non-finite floats (an exploding gradient norm) become their string names."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def capture_to_dict(capture: Capture) -> dict:
    """The `graph --format json` object (DESIGN.md): schema, config, device, summaries and the graph."""
    return _finite(
        {
            "schema": SCHEMA_VERSION,
            "config": capture.config.to_dict(),
            "device": capture.device,
            "loss": capture.loss,
            "summary": dataclasses.asdict(capture.summary),
            "memory": {**dataclasses.asdict(capture.memory), **memory_details(capture)},
            "flops": dataclasses.asdict(capture.flops),
            "time": dataclasses.asdict(capture.time),
            "backward_order": list(capture.backward_order),
            "save_order": [dataclasses.asdict(e) for e in capture.save_order],
            "graph": nx.node_link_data(capture.graph, edges="links"),
        }
    )


def to_json(capture: Capture) -> str:
    return json.dumps(capture_to_dict(capture), indent=1)


def to_graphml(graph: nx.DiGraph) -> str:
    """GraphML keeps scalars only: lists and dicts are stored as JSON text, None as an empty string."""
    flat = nx.DiGraph()
    for node, data in graph.nodes(data=True):
        flat.add_node(node, **{k: _graphml_value(v) for k, v in data.items()})
    flat.add_edges_from(graph.edges())
    return "\n".join(nx.generate_graphml(flat))


def _graphml_value(value: object) -> object:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return value


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph: nx.DiGraph) -> str:
    """Graphviz DOT: one box per node (op and module), filled by category; edges follow gradient flow."""
    lines = [
        "digraph autograd {",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
    ]
    for node, data in graph.nodes(data=True):
        label = data["op"] if not data.get("module") else f"{data['op']}\n{data['module']}"
        if data.get("param"):
            label = f"{data['param']['name']}\n{tuple(data['param']['shape'])}"
        colour = CATEGORY_COLOURS.get(data["category"], "#000000")
        shape = ", shape=ellipse" if data["category"] == "accumulate_grad" else ""
        lines.append(f"  {_dot_quote(node)} [label={_dot_quote(label)}, fillcolor={_dot_quote(colour)}{shape}];")
    for u, v in graph.edges():
        lines.append(f"  {_dot_quote(u)} -> {_dot_quote(v)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_svg(graph: nx.DiGraph) -> str:
    """SVG through Graphviz's `dot`; a ValueError that says how to get it when it is not installed."""
    dot = shutil.which("dot")
    if dot is None:
        raise ValueError(
            "SVG needs Graphviz's `dot` program, which is not installed; install it (apt-get install graphviz) "
            "or use --format dot / html."
        )
    done = subprocess.run([dot, "-Tsvg"], input=to_dot(graph), capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise ValueError(f"Graphviz `dot` failed: {done.stderr.strip().splitlines()[0] if done.stderr else done.returncode}")
    return done.stdout
