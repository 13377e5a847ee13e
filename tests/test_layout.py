"""Server-side layout: layers follow the gradient from the loss, ordering reduces crossings, and a deep
graph folds into side-by-side columns cut between blocks."""

import math

import networkx as nx
import pytest

import graphviz_core.graph.layout as layout_module
from graphviz_core.capture.engine import capture_backward
from graphviz_core.config import config_from_preset
from graphviz_core.graph.layout import ASPECT, count_crossings, layered_layout
from graphviz_core.graph.views import module_group
from tests.conftest import captured


def depths(layout) -> dict[str, int]:
    return {node: d for d, layer in enumerate(layout.layers) for node in layer}


def test_every_edge_points_down_a_layer_or_more():
    graph = captured("gpt2-tiny").graph
    layout = layered_layout(graph)
    assert set(layout.positions) == set(graph.nodes)
    depth = depths(layout)
    assert all(depth[u] < depth[v] for u, v in graph.edges())
    y = {n: p[1] for n, p in layout.positions.items()}
    column = {n: layout.column_of(d) for n, d in depth.items()}
    # within a column an edge points down the page; between columns it goes on at the next column's head
    assert all(y[u] < y[v] for u, v in graph.edges() if column[u] == column[v])
    assert all(column[u] <= column[v] for u, v in graph.edges())
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


def extent(layout) -> tuple[float, float]:
    xs = [x for x, _ in layout.positions.values()]
    ys = [y for _, y in layout.positions.values()]
    return max(xs) - min(xs) + layout_module.NODE_WIDTH, max(ys) - min(ys) + layout_module.LAYER_GAP


def test_a_short_chain_stays_one_column_and_a_long_one_folds_to_the_panes_shape():
    short = nx.path_graph(20, create_using=nx.DiGraph)  # 20 layers: 1,600 px, fits a 760 px pane at 0.47
    assert layered_layout(short).column_starts == (0,)
    long = nx.path_graph(200, create_using=nx.DiGraph)  # 200 layers, one node each: 16,000 px by 160 px
    layout = layered_layout(long)
    width, height = extent(layout)
    assert len(layout.column_starts) > 1
    assert abs(math.log(width / height / ASPECT)) < math.log(1.5), (width, height)
    # every column starts at the top of the drawing
    assert all(layout.positions[layout.layers[start][0]][1] == 0 for start in layout.column_starts)


def test_gpt2_small_folds_into_columns_cut_between_blocks():
    graph = capture_backward(config_from_preset("gpt2-small", device="meta")).graph
    layout = layered_layout(graph)
    # 12 blocks of ~24 layers + head and embeddings: 286 layers, one column 22,880 px tall and ~560 px wide
    assert len(layout.layers) == 286
    width, height = extent(layout)
    assert 0.75 < width / height < 3, (width, height)  # was 560 / 22,880 = 0.02
    depth = depths(layout)
    for start in layout.column_starts[1:]:
        # no block has operations both above the cut and below it (parameters are leaves and may sit a row
        # into the next block's backward, next to their consumer's neighbours)
        above = {module_group(graph.nodes[n]["module"], 2) for n in graph if depth[n] < start and graph.out_degree(n)}
        below = {module_group(graph.nodes[n]["module"], 2) for n in graph if depth[n] >= start and graph.out_degree(n)}
        assert not (above & below) - {""}, (start, above & below)


def test_long_labels_get_room_so_no_box_covers_its_neighbour():
    from graphviz_core.export.render import node_widths
    from graphviz_core.graph.layout import MIN_CLEARANCE
    from graphviz_core.graph.views import hide_categories

    # Shape ops hidden (the view's checkbox): each attention output projection's weight and bias ovals then sit in
    # the fused attention node's layer.
    graph = hide_categories(captured("gpt2-tiny").graph, {"shape"})
    widths = node_widths(graph)
    # The fused attention node's label line "ScaledDotProductFlashAttentionForCpu" is 36 characters: 36 * 7.8 px
    # + 14 = 294.8 px, and the ovals beside it ("blocks.1.attn.proj.weight", 25 characters: 25 * 7.8 * 1.15 + 24
    # = 248.25 px) need (294.8 + 248.25) / 2 = 271.5 px between centres: more than the fixed NODE_GAP of 200.
    attention = next(n for n, d in graph.nodes(data=True) if d["op"].startswith("ScaledDotProductFlash"))
    assert widths[attention] == pytest.approx(36 * 7.8 + 14)

    def overlaps(layout):
        found = []
        for layer in layout.layers:
            row = sorted(layer, key=lambda n: layout.positions[n][0])
            for a, b in zip(row, row[1:], strict=False):
                gap = layout.positions[b][0] - layout.positions[a][0]
                if gap < (widths[a] + widths[b]) / 2 + MIN_CLEARANCE - 1e-9:
                    found.append((a, b))
        return found

    assert any(attention in pair for pair in overlaps(layered_layout(graph)))  # fixed spacing: it is covered
    assert overlaps(layered_layout(graph, widths=widths)) == []
