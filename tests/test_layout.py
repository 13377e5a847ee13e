"""Server-side layout: layers follow the gradient from the loss, and ordering reduces crossings."""

import networkx as nx

import graphviz_core.layout as layout_module
from graphviz_core.layout import count_crossings, layered_layout
from tests.conftest import captured


def test_every_edge_points_down_a_layer_or_more():
    graph = captured("gpt2-tiny").graph
    layout = layered_layout(graph)
    assert set(layout.positions) == set(graph.nodes)
    y = {n: p[1] for n, p in layout.positions.items()}
    assert all(y[u] < y[v] for u, v in graph.edges())
    loss = next(n for n in graph.nodes if graph.in_degree(n) == 0)
    assert y[loss] == 0 and layout.layers[0] == [loss]


def test_barycentre_sweeps_remove_a_crossing_the_generation_order_has(monkeypatch):
    # Generations: [r], [a, b], then x and y in the order their last parent is processed: a lowers y's
    # in-degree to 1, then b releases x and y, so the order is [x, y]. Edges a->y (0 -> 1) and b->x (1 -> 0)
    # cross once. A downward sweep puts y at the mean of its parents a, b (0.5) and x at b's (1): [y, x],
    # and nothing crosses.
    graph = nx.DiGraph([("r", "a"), ("r", "b"), ("a", "y"), ("b", "x"), ("b", "y")])
    monkeypatch.setattr(layout_module, "SWEEPS", 0)
    naive = layered_layout(graph)
    assert naive.layers[2] == ["x", "y"] and count_crossings(graph, naive) == 1
    monkeypatch.setattr(layout_module, "SWEEPS", 4)
    swept = layered_layout(graph)
    assert swept.layers[2] == ["y", "x"] and count_crossings(graph, swept) == 0
