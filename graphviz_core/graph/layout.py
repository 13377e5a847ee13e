"""Server-side positions for the graph view: layers by topological generation, ordered to cut crossings.

The loss is the only source (edges run the way gradients flow), so generation 0 is the loss and the
parameters' AccumulateGrad nodes sit at the bottom. Within a layer, nodes are ordered by the barycentre
heuristic (Sugiyama et al. 1981): a few sweeps down and up, each placing a node at the mean position of its
neighbours in the layer before. O(sweeps x edges), so ~10,000 nodes lay out in well under a second.

A deep network is hundreds of layers tall and three nodes wide: fitted to a screen it is one hairline
column (gpt2-small: 286 layers, scale 0.03). So the layer sequence is folded into side-by-side columns, like
a newspaper, as many as bring the drawing's width : height nearest the screen's (ASPECT), each cut between two
module groups (transformer blocks) where one is near, else where the fewest edges cross.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import networkx as nx

from graphviz_core.graph.views import module_group

LAYER_GAP = 80  # px between layers
NODE_GAP = 200  # px between neighbours in a layer
SWEEPS = 4
ASPECT = 1.5  # width : height of the graph's pane (the app's iframe and the standalone page, both ~1.3-2.1)
NODE_WIDTH = 160  # px a typical box takes ("NativeLayerNorm / blocks.11.ln_1" at 13 px monospace)
MIN_CLEARANCE = 40  # px at least between two neighbouring boxes' edges
COLUMN_GAP = 240  # px between folded columns, wider than NODE_GAP so columns read as columns
# A column of 20 layers (1,600 px) fits a 760 px pane at scale 0.47, labels still readable: no fold needed.
FOLD_ABOVE_LAYERS = 20


@dataclass(frozen=True)
class Layout:
    """x, y per node id, the layers (0 = the loss), and the first layer of each folded column."""

    positions: dict[str, tuple[float, float]]
    layers: list[list[str]]
    column_starts: tuple[int, ...] = (0,)

    def column_of(self, depth: int) -> int:
        return sum(1 for start in self.column_starts if start <= depth) - 1


def layered_layout(graph: nx.DiGraph, aspect: float = ASPECT, widths: Mapping[str, float] | None = None) -> Layout:
    """Positions for every node; a view with cycles (collapsed modules can make them) is laid out on an
    acyclic copy without its DFS back edges, which are still drawn. Layers run down each column, columns
    left to right (`aspect` = the pane's width : height the fold aims for). `widths`: px each node's box takes
    (render.node_widths; NODE_WIDTH where not given): neighbours in a layer sit at least NODE_GAP apart and never
    closer than their half-widths plus MIN_CLEARANCE, so a long label ("ScaledDotProductFlashAttentionForCpu") does
    not cover the parameter ovals beside it."""
    graph = _without_back_edges(graph)
    layers = [list(generation) for generation in nx.topological_generations(graph)]
    order = {node: i for layer in layers for i, node in enumerate(layer)}
    for sweep in range(SWEEPS):
        downward = sweep % 2 == 0
        sequence = layers[1:] if downward else layers[-2::-1]
        for layer in sequence:
            neighbours = graph.predecessors if downward else graph.successors
            keys = {}
            for node in layer:
                placed = [order[n] for n in neighbours(node)]
                keys[node] = sum(placed) / len(placed) if placed else order[node]
            layer.sort(key=lambda n: (keys[n], order[n]))
            for i, node in enumerate(layer):
                order[node] = i
    width = (lambda node: widths.get(node, NODE_WIDTH)) if widths else (lambda node: NODE_WIDTH)
    offsets = {depth: _spread(layer, width) for depth, layer in enumerate(layers)}
    pitch = (max((o[-1] for o in offsets.values()), default=0.0)
             + max(NODE_WIDTH, max((width(n) for layer in layers for n in layer), default=0.0)) + COLUMN_GAP)
    starts = _column_starts(graph, layers, aspect, pitch)
    bounds = [*starts, len(layers)]
    positions = {}
    left = 0.0
    for start, stop in zip(bounds, bounds[1:], strict=False):
        span = max(offsets[depth][-1] for depth in range(start, stop))
        centre = left + span / 2
        for depth in range(start, stop):
            half = offsets[depth][-1] / 2
            for node, x in zip(layers[depth], offsets[depth], strict=True):
                positions[node] = (centre + x - half, (depth - start) * LAYER_GAP)
        widest_node = max(width(node) for layer in layers[start:stop] for node in layer)
        left += span + max(NODE_WIDTH, widest_node) + COLUMN_GAP
    if len(starts) == 1:  # one column: centred on x = 0, as before folding existed
        positions = {node: (x - centre, y) for node, (x, y) in positions.items()}
    return Layout(positions, layers, tuple(starts))


def _spread(layer: list[str], width) -> list[float]:
    """x of each node of a layer from the first's, left to right: NODE_GAP apart, or more where boxes are wide."""
    xs = [0.0]
    for left, right in zip(layer, layer[1:], strict=False):
        xs.append(xs[-1] + max(NODE_GAP, (width(left) + width(right)) / 2 + MIN_CLEARANCE))
    return xs


def _column_starts(graph: nx.DiGraph, layers: list[list[str]], aspect: float, pitch: float) -> list[int]:
    """The first layer of each column: the column count whose drawing is nearest `aspect`; each cut moved
    (within half a column) to split the fewest module groups (blocks.3, model.layers.3...) and then the
    fewest edges, so repeated blocks stand side by side whole."""
    count = len(layers)

    def misfit(columns: int) -> float:
        width = columns * pitch - COLUMN_GAP
        height = math.ceil(count / columns) * LAYER_GAP
        return abs(math.log(width / height / aspect))

    if count <= FOLD_ABOVE_LAYERS:
        return [0]
    columns = min(range(1, count + 1), key=misfit)
    if columns == 1:
        return [0]
    depth = {node: d for d, layer in enumerate(layers) for node in layer}
    # crossing[c]: edges from a layer above c to layer c or below, i.e. cut if a column starts at c
    crossing = [0] * (count + 1)
    for u, v in graph.edges():
        low, high = sorted((depth[u], depth[v]))
        if low < high:
            crossing[low + 1] += 1
            crossing[high + 1] -= 1
    # split[c]: module groups with nodes both above layer c and at or below it
    # (leaves left out: a block's LayerNorm parameters sit one layer into the next block's backward)
    spans: dict[str, list[int]] = {}
    for node, d in depth.items():
        group = module_group(graph.nodes[node].get("module", ""), 2)
        if group and graph.out_degree(node):
            span = spans.setdefault(group, [d, d])
            span[0], span[1] = min(span[0], d), max(span[1], d)
    split = [0] * (count + 1)
    for low, high in spans.values():
        if low < high:
            split[low + 1] += 1
            split[high + 1] -= 1
    for c in range(1, count + 1):
        crossing[c] += crossing[c - 1]
        split[c] += split[c - 1]
    window = max(1, count // (2 * columns))
    starts = [0]
    for j in range(1, columns):
        ideal = round(j * count / columns)
        candidates = range(max(starts[-1] + 1, ideal - window), min(count - 1, ideal + window) + 1)
        if not candidates:
            break
        starts.append(min(candidates, key=lambda c: (split[c], crossing[c], abs(c - ideal))))
    return starts


def _without_back_edges(graph: nx.DiGraph) -> nx.DiGraph:
    if nx.is_directed_acyclic_graph(graph):
        return graph
    dag = nx.DiGraph()
    dag.add_nodes_from(graph)
    state: dict = {}  # 1 = on the DFS stack, 2 = done
    roots = sorted(graph, key=lambda n: graph.in_degree(n) != 0)  # sources first, stable otherwise
    for root in roots:
        if root in state:
            continue
        state[root] = 1
        stack = [(root, iter(graph.successors(root)))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
            elif state.get(child) == 1:
                continue  # back edge: leave it out of the layering
            else:
                dag.add_edge(node, child)
                if child not in state:
                    state[child] = 1
                    stack.append((child, iter(graph.successors(child))))
    return dag


def count_crossings(graph: nx.DiGraph, layout: Layout) -> int:
    """Edge crossings between adjacent layers (edges spanning several layers are checked at their ends)."""
    x = {node: pos[0] for node, pos in layout.positions.items()}
    y = {node: pos[1] for node, pos in layout.positions.items()}
    by_band: dict[float, list[tuple[float, float]]] = {}
    for u, v in graph.edges():
        by_band.setdefault(y[u], []).append((x[u], x[v]))
    crossings = 0
    for edges in by_band.values():
        edges.sort()
        for i, (a1, b1) in enumerate(edges):
            for a2, b2 in edges[i + 1:]:
                if a2 > a1 and b2 < b1:
                    crossings += 1
    return crossings
