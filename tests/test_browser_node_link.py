"""A link to one node: made in the graph's details panel, opened by someone else with that node selected."""

from urllib.parse import parse_qs, urlparse

import pytest

from graphviz_core.ui.browser_harness import graph_frame
from graphviz_core.ui.graph_view import apply_view
from tests.conftest import LAPTOP, both_sizes, captured
from tests.test_browser import node_point

pytestmark = pytest.mark.browser


def _selected_and_shown(frame, node: str) -> dict:
    """What the opened graph says about `node`: selected?, its details panel, and whether it is inside the pane."""
    return frame.evaluate(
        """id => {
            const net = window.network, at = net.canvasToDOM(net.getPosition(id));
            const pane = document.getElementById('graph');
            return {selected: net.getSelectedNodes(), details: document.getElementById('details').innerText,
                    inside: at.x >= 0 && at.y >= 0 && at.x <= pane.clientWidth && at.y <= pane.clientHeight};
        }""",
        node,
    )


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_a_node_link_opens_that_node_selected_with_its_details_in_a_fresh_browser(
    page, second_page, streamlit_url, tmp_path
):
    capture = captured("gpt2-tiny", layers=6)  # too tall to fit at a readable scale: the graph opens on the loss
    view = apply_view(capture, focus=None, hide_shape=True, collapse=False, expanded=None)
    # the first block's qkv matmul, the last the backward pass reaches: off screen when the graph opens on the loss
    module = "blocks.0.attn.qkv"
    node = next(n for n, d in view.nodes(data=True) if d["category"] == "matmul" and d["module"] == module)
    # someone picks a node in their graph and copies its link
    source = second_page
    source.goto(f"{streamlit_url}/?layers=6")
    graph_frame(source, capture.summary.nodes)
    source.get_by_text("Hide shape ops").click()  # a view setting, changed after the page opened
    frame = graph_frame(source, view.number_of_nodes())
    assert not _selected_and_shown(frame, node)["inside"]
    frame.evaluate("id => window.network.focus(id, {scale: 1, animation: false})", node)
    source.mouse.click(*node_point(frame, node))
    frame.get_by_role("button", name="Copy link to this node").click()
    link = frame.locator("#node-link input")
    link.wait_for(timeout=5_000)
    url = link.input_value()
    assert not source.errors, source.errors
    query = parse_qs(urlparse(url).query)
    assert url.startswith(streamlit_url) and query["node"] == [node] and query["hide_shape"] == ["1"], url
    assert query["layers"] == ["6"], url

    # a teammate opens it: a fresh context, nothing in its session
    page.goto(url)
    frame = graph_frame(page, view.number_of_nodes())
    shown = _selected_and_shown(frame, node)
    assert shown["selected"] == [node] and shown["inside"], shown
    assert f"id\t{node}" in shown["details"] and f"module\t{module}" in shown["details"], shown["details"]
    assert page.locator("label").filter(has_text="Hide shape ops").locator("input").is_checked()
    assert not page.locator('[data-testid="stAlert"]').filter(has_text="could not be used").count()
    both_sizes(page, tmp_path / "node-link")
