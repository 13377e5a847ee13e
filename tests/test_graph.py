"""View transforms over a real captured graph: hiding, collapsing, focusing, searching."""

import networkx as nx

from graphviz_core.graph.views import collapse_modules, focus_module, hide_categories, module_groups, search_nodes
from tests.conftest import captured


def test_hiding_shape_ops_removes_exactly_them_and_keeps_paths():
    graph = captured("gpt2-tiny").graph
    shapes = {n for n, d in graph.nodes(data=True) if d["category"] == "shape"}
    view = hide_categories(graph, {"shape"})
    assert set(view.nodes) == set(graph.nodes) - shapes
    # Every parameter is still reachable from the loss once edges are bridged through the shape ops.
    root = next(n for n in graph.nodes if graph.in_degree(n) == 0)
    reachable = set(nx.descendants(view, root))
    params = {n for n, d in graph.nodes(data=True) if d["op"] == "AccumulateGrad"}
    assert params <= reachable
    assert graph.number_of_nodes() == captured("gpt2-tiny").summary.nodes  # the capture's graph is untouched


def test_collapsing_keeps_totals_and_expanding_opens_one_module():
    capture = captured("gpt2-tiny")
    graph = capture.graph
    view = collapse_modules(graph, depth=2)
    groups = {n: d for n, d in view.nodes(data=True) if d["category"] == "module"}
    # gpt2-tiny at depth 2: blocks.0, blocks.1, wte, wpe, ln_f, lm_head are modules; loss nodes and the
    # embedding add (module "") stay as they are.
    assert sorted(d["module"] for d in groups.values()) == ["blocks.0", "blocks.1", "lm_head", "ln_f", "wpe", "wte"]
    assert sum(d["saved_bytes"] for _, d in view.nodes(data=True)) == capture.memory.saved_bytes
    assert sum(d["flops"] for _, d in view.nodes(data=True)) == sum(d["flops"] for _, d in graph.nodes(data=True))
    block0 = sum(1 for _, d in graph.nodes(data=True) if d["module"].startswith("blocks.0"))
    assert groups["module:blocks.0"]["members"] == block0
    opened = collapse_modules(graph, depth=2, expanded="blocks.0")
    assert opened.number_of_nodes() == view.number_of_nodes() - 1 + block0


def test_focus_and_search():
    graph = captured("gpt2-tiny").graph
    focused = focus_module(graph, "blocks.1")
    assert focused.number_of_nodes() > 0
    assert all(d["module"].startswith("blocks.1") for _, d in focused.nodes(data=True))
    assert module_groups(graph) == ["blocks.0", "blocks.1", "lm_head", "ln_f", "wpe", "wte"]
    hits = search_nodes(graph, "gelu")
    assert {graph.nodes[n]["op"] for n in hits} == {"GeluBackward0"} and len(hits) == 2
    assert search_nodes(graph, "   ") == set()


def test_one_member_module_label_is_singular():
    graph = captured("gpt2-tiny").graph.copy()
    node = next(n for n, d in graph.nodes(data=True) if d["module"])
    graph.nodes[node]["module"] = "solo"  # a module holding exactly this one node, like lm_head
    view = collapse_modules(graph, depth=1)
    assert view.nodes["module:solo"]["op"] == "solo (1 node)"
    assert all(not d["op"].endswith("(1 nodes)") for _, d in view.nodes(data=True))


def test_collapsing_inside_a_focused_module_keeps_its_parts_apart():
    """Focus on blocks.1 with Collapse modules on used to merge the focused block itself into one node ("Showing 1 of
    101 nodes"). Now its parts are one node each and its own ops stay: gpt2-tiny's block is ln_1, attn, ln_2, mlp
    plus its two residual adds (module "blocks.1") = 6 nodes, once shape ops are hidden."""
    from graphviz_core.ui.graph_view import apply_view

    capture = captured("gpt2-tiny")
    view = apply_view(capture, focus="blocks.1", hide_shape=True, collapse=True, expanded=None)
    groups = sorted(d["module"] for _, d in view.nodes(data=True) if d["category"] == "module")
    assert groups == ["blocks.1.attn", "blocks.1.ln_1", "blocks.1.ln_2", "blocks.1.mlp"]
    assert sorted(d["op"] for _, d in view.nodes(data=True) if d["category"] != "module") == ["AddBackward0"] * 2
    assert sum(d["category"] == "module" for _, d in view.nodes(data=True)) + 2 == view.number_of_nodes() == 6
    whole = apply_view(capture, focus=None, hide_shape=True, collapse=True, expanded=None)
    assert "module:blocks.1" in whole  # without a focus, blocks stay one node each
