"""Views over a captured graph (graph/schema.py's records): hide categories, collapse modules, focus on one.

Pure functions from a DiGraph to a new DiGraph; the capture's graph is never modified. The graph view
applies them, so changing a view never re-runs the backward pass.
"""

from __future__ import annotations

from collections import Counter

import networkx as nx

# Summed when nodes are merged into one module node.
ADDITIVE = ("saved_bytes", "flops", "recompute_flops")


def hide_categories(graph: nx.DiGraph, hidden: set[str]) -> nx.DiGraph:
    """Drop nodes of the `hidden` categories; bridge edges through them so gradient paths stay connected."""
    keep = [n for n, d in graph.nodes(data=True) if d["category"] not in hidden]
    kept = set(keep)
    view = nx.DiGraph()
    view.add_nodes_from((n, graph.nodes[n]) for n in keep)
    for node in keep:
        # Walk forward through hidden nodes until kept ones are reached.
        stack, seen = list(graph.successors(node)), set()
        while stack:
            nxt = stack.pop()
            if nxt in seen:
                continue
            seen.add(nxt)
            if nxt in kept:
                view.add_edge(node, nxt)
            else:
                stack.extend(graph.successors(nxt))
    return view


def module_group(module: str, depth: int) -> str:
    """The first `depth` parts of a dotted module path ("blocks.3.attn.core", 2 -> "blocks.3"), extended to the
    layer index when one follows within two parts (transformers: "model.layers.3.mlp" -> "model.layers.3",
    "bert.encoder.layer.3.output" -> "bert.encoder.layer.3"), so each layer stays its own group."""
    if not module:
        return ""
    parts = module.split(".")
    for i in range(depth, min(depth + 2, len(parts))):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:depth])


def collapse_modules(
    graph: nx.DiGraph, depth: int = 2, expanded: str | None = None, within: str | None = None
) -> nx.DiGraph:
    """Merge each module (its path cut to `depth` parts) into one node carrying its totals.

    Nodes outside every module (the loss, ops in the top-level forward) stay as they are, and so do the
    nodes of the `expanded` module, so a user can open one module at a time. With `within` (a focused module), the
    modules inside it are merged at `depth` = its own parts + 1, and its own ops (a layer's residual adds) stay.
    """
    if within:
        depth = len(within.split(".")) + 1
    group_of = {}
    for node, data in graph.nodes(data=True):
        group = module_group(data["module"], depth)
        own = group == expanded or (within is not None and data["module"] == within)
        group_of[node] = node if not group or own else f"module:{group}"
    view = nx.DiGraph()
    members: dict[str, list[str]] = {}
    for node, group in group_of.items():
        members.setdefault(group, []).append(node)
    for group, nodes in members.items():
        if len(nodes) == 1 and group == nodes[0]:
            view.add_node(group, **graph.nodes[group])
            continue
        datas = [graph.nodes[n] for n in nodes]
        times = [d["time_s"] for d in datas if d["time_s"] is not None]
        view.add_node(
            group,
            op=f"{group.removeprefix('module:')} ({len(nodes)} node{'' if len(nodes) == 1 else 's'})",
            category="module",
            module=group.removeprefix("module:"),
            **{key: sum(d.get(key, 0) for d in datas) for key in ADDITIVE},
            time_s=sum(times) if times else None,
            grad_norm=None,
            param=None,
            saved=[],
            members=len(nodes),
            by_category=dict(Counter(d["category"] for d in datas)),
            parameters=sum(1 for d in datas if d["param"]),
        )
    for u, v in graph.edges():
        gu, gv = group_of[u], group_of[v]
        if gu != gv:
            view.add_edge(gu, gv)
    return view


def focus_module(graph: nx.DiGraph, prefix: str) -> nx.DiGraph:
    """The subgraph of nodes whose module is `prefix` or inside it."""
    keep = [n for n, d in graph.nodes(data=True) if d["module"] == prefix or d["module"].startswith(prefix + ".")]
    return graph.subgraph(keep).copy()


def module_groups(graph: nx.DiGraph, depth: int = 2) -> list[str]:
    """The distinct module groups at `depth`, in graph order (for focus/expand pickers)."""
    seen: dict[str, None] = {}
    for _, data in graph.nodes(data=True):
        group = module_group(data["module"], depth)
        if group:
            seen.setdefault(group, None)
    return sorted(seen, key=_natural_key)


def _natural_key(path: str) -> list:
    return [int(part) if part.isdigit() else part for part in path.split(".")]


def search_nodes(graph: nx.DiGraph, query: str) -> set[str]:
    """Ids of nodes whose op, module or parameter name contains `query` (case-insensitive)."""
    q = query.strip().lower()
    if not q:
        return set()
    found = set()
    for node, data in graph.nodes(data=True):
        text = f"{data['op']} {data['module']} {(data.get('param') or {}).get('name', '')}".lower()
        if q in text:
            found.add(node)
    return found
