"""The sidebar's link box: always the page as it is now, after view changes the graph's fragment made on its own."""

from urllib.parse import parse_qs, urlparse

import pytest

from graphviz_core.ui.browser_harness import graph_frame
from graphviz_core.ui.graph_view import apply_view
from tests.conftest import captured
from tests.test_browser import node_point

pytestmark = pytest.mark.browser


def _linked(page, wanted: dict[str, str]) -> dict[str, list[str]]:
    """The sidebar box's link, once it carries every parameter in `wanted` (it follows the address bar)."""
    box = page.locator('[data-testid="stSidebar"] .copy-link textarea')
    page.wait_for_function(
        "([sel, wanted]) => { const v = document.querySelector(sel).value;"
        " return Object.entries(wanted).every(([k, x]) => new URL(v).searchParams.get(k) === x); }",
        arg=['[data-testid="stSidebar"] .copy-link textarea', wanted],
        timeout=10_000,
    )
    return parse_qs(urlparse(box.input_value()).query)


@pytest.mark.parametrize("page", [(1280, 800)], indirect=True)
def test_the_link_box_follows_the_view_and_copying_keeps_the_selected_node(page, streamlit_url, tmp_path):
    capture = captured("gpt2-tiny")
    page.goto(streamlit_url)
    graph_frame(page, capture.summary.nodes)  # 101 nodes
    assert "hide_shape" not in _linked(page, {"preset": "gpt2-tiny"})  # the default view adds nothing to the link
    page.get_by_text("Hide shape ops").click()  # the graph's fragment reruns; the sidebar is not redrawn
    graph_frame(page, apply_view(capture, focus=None, hide_shape=True, collapse=False, expanded=None).number_of_nodes())
    assert _linked(page, {"hide_shape": "1"})["preset"] == ["gpt2-tiny"]  # the config stays in the link
    page.get_by_text("Collapse modules").click()
    collapsed = apply_view(capture, focus=None, hide_shape=True, collapse=True, expanded=None)
    frame = graph_frame(page, collapsed.number_of_nodes())
    assert _linked(page, {"hide_shape": "1", "collapse": "1"})["preset"] == ["gpt2-tiny"]
    # a node picked in the graph stays picked through Copy link: the button is the browser's, no rerun
    node = next(iter(collapsed.nodes))
    frame.evaluate("id => window.network.focus(id, {scale: 1, animation: false})", node)
    page.mouse.click(*node_point(frame, node))
    assert frame.evaluate("window.network.getSelectedNodes()") == [node]
    page.locator('[data-testid="stSidebar"] .copy-link').get_by_role("button", name="Copy link").click()
    page.locator('[data-testid="stSidebar"] .copy-link-status').filter(has_text="copied").or_(
        page.locator('[data-testid="stSidebar"] .copy-link-status').filter(has_text="select the link")
    ).wait_for(timeout=5_000)
    page.wait_for_timeout(1_000)  # a rerun, had there been one, would have replaced the graph's frame by now
    assert frame.evaluate("window.network.getSelectedNodes()") == [node]
    page.screenshot(path=tmp_path / "copy-link-1280.png")
