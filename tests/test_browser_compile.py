"""The form's torch.compile checkbox in Chromium: the run is compiled, its compiled node opens in the graph's details
panel and in the Compiled backward section, whose FX graph draws every FX node (page errors fail the test)."""

import pytest

from graphviz_core.ui.browser_harness import graph_frame
from tests.conftest import LAPTOP, both_sizes, captured
from tests.test_browser import node_point

pytestmark = pytest.mark.browser


def _details_of(page, frame, node: str) -> str:
    """Click `node` and read its details panel; on a loaded machine the click can land before the view has settled
    after the focus, so it is tried again until the panel names a node (up to 5 tries)."""
    selected = "() => !document.getElementById('details').innerText.startsWith('No node selected')"
    for _ in range(5):
        frame.evaluate("id => window.network.focus(id, {scale: 1, animation: false})", node)
        page.mouse.click(*node_point(frame, node))
        try:
            frame.wait_for_function(selected, timeout=3_000)
            break
        except Exception:  # noqa: BLE001 - Playwright's TimeoutError: click again
            continue
    return frame.evaluate("() => document.getElementById('details').innerText")


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_the_compile_checkbox_runs_compiled_and_its_compiled_node_opens(page, streamlit_url, tmp_path):
    capture = captured("gpt2-tiny", compile=True)  # the same config, captured here: its node ids and FX graph
    (node,) = [n for n, d in capture.graph.nodes(data=True) if d["op"] == "CompiledFunctionBackward"]
    opened = capture.graph.nodes[node]["compiled"]
    page.goto(f"{streamlit_url}/?preset=gpt2-tiny")
    graph_frame(page, captured("gpt2-tiny").summary.nodes, timeout_s=120)  # the eager graph first
    sidebar = page.locator('[data-testid="stSidebar"]')
    sidebar.locator("label").filter(has_text="torch.compile").click()
    sidebar.get_by_role("button", name="Run backward pass").click()
    page.get_by_text("Compiled backward: 1 compiled node, 0 graph breaks").wait_for(timeout=240_000)
    assert page.locator('[data-testid="stCaptionContainer"]').filter(has_text="torch.compile").count() >= 1

    # the compiled node in the graph: its details panel opens it
    frame = graph_frame(page, capture.summary.nodes)
    details = _details_of(page, frame, node)
    assert "compiled region\t1: backward FX graph of 279 nodes" in details.replace(",", ""), details
    assert "recomputed forward ops" in details

    # the Compiled backward section: its FX graph drawn node for node, a recomputed op opened
    page.get_by_text("Compiled backward: 1 compiled node").click()
    fx = graph_frame(page, opened["backward_nodes"], timeout_s=120)
    page.get_by_text("its backward FX graph has").scroll_into_view_if_needed()
    both_sizes(page, tmp_path / "compiled-open")
    fx.get_by_role("button", name="Zoom to the incoming gradient").click()  # the FX graph's own words: it has no loss
    recomputed = opened["recomputed"][0]["name"]
    details = _details_of(page, fx, recomputed)
    assert f"FX node\t{recomputed}" in details and "computed again here" in details, details
    page.get_by_role("tab", name="FX nodes").click()
    both_sizes(page, tmp_path / "compiled", full_page=True)
