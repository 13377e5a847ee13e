"""The rendered page: self-contained, escaped, one vis node per graph node."""

import json
import re

import pytest

from graphviz_core.render import node_details, render_html, render_standalone_html
from tests.conftest import captured


def graph_data(html: str) -> dict:
    match = re.search(r'<script nonce="[^"]+" id="graph-data" type="application/json">(.*?)</script>', html, re.S)
    return json.loads(match.group(1))


def test_page_holds_every_node_and_edge_with_positions():
    capture = captured("gpt2-tiny")
    data = graph_data(render_standalone_html(capture))
    assert len(data["nodes"]) == capture.summary.nodes and len(data["edges"]) == capture.summary.edges
    assert all("x" in n and "y" in n for n in data["nodes"])
    assert data["options"]["physics"]["enabled"] is False
    params = [n for n in data["nodes"] if n["shape"] == "ellipse"]
    assert len(params) == capture.summary.parameters  # parameters look different from operations


def test_no_external_resource_is_referenced():
    html = render_standalone_html(captured("mlp"))
    assert not re.search(r'<(script|link|img|iframe)[^>]+(src|href)=', html)
    assert "default-src 'none'" in html


def test_hostile_strings_are_escaped_everywhere():
    graph = captured("mlp", layers=1).graph.copy()
    node = next(iter(graph.nodes))
    evil = '<img src=x onerror="window.__xss=1"></script><script>window.__xss=2</script>'
    graph.nodes[node]["module"] = evil
    html = render_html(graph, title=evil, subtitle=evil)
    assert "<img src=x" not in html
    assert "</script><script>window.__xss" not in html
    assert graph_data(html)["details"][node][3] == ["module", evil]  # intact as data, shown via textContent


def test_unknown_metric_is_a_value_error():
    with pytest.raises(ValueError, match="unknown metric 'speed'"):
        render_html(captured("mlp").graph, colour_by="speed")


def test_gradient_norm_says_what_it_is_the_norm_of():
    graph = captured("mlp", layers=1).graph
    labels = {}
    for node, data in graph.nodes(data=True):
        rows = dict(node_details(node, data))
        labels[data["category"]] = [k for k in rows if k.startswith("gradient norm")][0]
    # a residual add sends |g| to both inputs, so its norm is sqrt(2)*|g|: the label must say "combined"
    assert any("combined" in label for cat, label in labels.items() if cat != "accumulate_grad")
    assert labels["accumulate_grad"] == "gradient norm (this parameter's gradient)"
