"""The graph explorer in a real browser: it draws, counts match the capture, and nothing leaves localhost."""

from urllib.parse import urlparse

import pytest

from graphviz_core.export.formats import wait_until_drawn
from graphviz_core.export.render import render_html, render_standalone_html
from graphviz_core.ui.browser_harness import graph_frame
from tests.conftest import captured

pytestmark = pytest.mark.browser


def node_point(frame, node: str) -> tuple[float, float]:
    """Where `node` is drawn, in the page's coordinates (the frame's offset added for an iframe)."""
    x, y = frame.evaluate("id => { const p = window.network.canvasToDOM(window.network.getPosition(id));"
                          " return [p.x, p.y]; }", node)
    # canvasToDOM is relative to the graph's container; Playwright's bounding_box of an element inside a
    # frame is already in the page's coordinates.
    frame.locator("#graph").scroll_into_view_if_needed()
    graph = frame.locator("#graph").bounding_box()
    return graph["x"] + x, graph["y"] + y


def hover_and_leave(page, frame, node: str) -> str:
    """Show `node` at scale 1, hover it until its tooltip shows, return the tooltip's text, then move off the graph.

    Until the reader drags or zooms, the page chooses its first view again whenever its frame is resized (Streamlit
    sizes the frame after the first draw; assets/graph_view.html.j2, "resize"), and a programmatic focus is neither:
    a resize that landed after the focus moved the node from under the pointer (a loaded run: the tooltip never
    showed). So the node is shown and hovered again, up to three times, where it then is."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(3):
        frame.evaluate("id => window.network.focus(id, {scale: 1.0, animation: false})", node)
        x, y = node_point(frame, node)
        page.mouse.move(x - 40, y - 40)
        page.mouse.move(x, y, steps=5)
        try:
            frame.locator("#tip").wait_for(state="visible", timeout=5_000)
            break
        except PlaywrightTimeout:
            if attempt == 2:
                raise
    text = frame.locator("#tip").inner_text()
    page.mouse.move(x + 600, y + 600, steps=5)
    page.mouse.move(1, 1)
    frame.locator("#tip").wait_for(state="hidden", timeout=5_000)
    return text

def test_page_draws_the_capture_and_requests_only_localhost(page, streamlit_url):
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(streamlit_url)
    capture = captured("gpt2-tiny")
    frame = graph_frame(page, capture.summary.nodes)
    assert frame.evaluate("window.network.body.data.edges.length") == capture.summary.edges
    # vis-network drew every node on its canvas: each has a computed bounding box.
    drawn = frame.evaluate("Object.keys(window.network.getPositions()).length")
    assert drawn == capture.summary.nodes
    hosts = {urlparse(u).hostname for u in requests if urlparse(u).scheme in ("http", "https", "ws", "wss")}
    assert hosts <= {"127.0.0.1", "localhost"}, hosts
    # vis-network came from the app's own static folder (ui/vis_script.py), not inlined into the frame's srcdoc
    assert [urlparse(u).path for u in requests if ".min.js" in u] == ["/app/static/vis-network.min.js"]
    assert "new vis.Network" in frame.content() and len(frame.content()) < 200_000


def test_hiding_shape_ops_removes_exactly_the_shape_nodes(page, streamlit_url):
    page.goto(streamlit_url)
    capture = captured("gpt2-tiny")
    graph_frame(page, capture.summary.nodes)
    page.get_by_text("Hide shape ops").click()
    shape = capture.summary.by_category["shape"]
    frame = graph_frame(page, capture.summary.nodes - shape)
    drawn = set(frame.evaluate("window.network.body.data.nodes.getIds()"))
    non_shape = {n for n, d in capture.graph.nodes(data=True) if d["category"] != "shape"}
    assert drawn == non_shape and len(drawn) == 101 - 46  # gpt2-tiny: 101 nodes, 46 of them shape ops


def test_collapsing_modules_draws_the_collapsed_count(page, streamlit_url):
    page.goto(streamlit_url)
    capture = captured("gpt2-tiny")
    graph_frame(page, capture.summary.nodes)
    page.get_by_text("Collapse modules").click()
    # 6 module nodes (blocks.0, blocks.1, wte, wpe, ln_f, lm_head) + nodes outside modules: the loss's
    # NllLoss, LogSoftmax and the view before it, plus the wte + wpe add in GPT2.forward.
    outside = sum(1 for _, d in capture.graph.nodes(data=True) if d["module"] == "")
    graph_frame(page, 6 + outside)


def test_hostile_labels_show_as_text_and_run_no_script(page, tmp_path):
    graph = captured("mlp", layers=1).graph.copy()
    node = next(iter(graph.nodes))
    evil = '<img src=x onerror="window.__xss=1"></script><script>window.__xss=2</script>'
    graph.nodes[node]["module"] = evil
    graph.nodes[node]["op"] = evil
    path = tmp_path / "evil.html"
    path.write_text(render_html(graph, title=evil, subtitle=evil))
    page.goto(path.as_uri())
    wait_until_drawn(page, 30_000)
    page.evaluate(f"window.showDetails({node!r})")
    assert page.evaluate("window.__xss") is None
    assert page.locator("#details").inner_text().count(evil) == 2  # op and module, as literal text
    assert page.locator("h1").inner_text() == evil
    assert page.locator("img").count() == 0


def test_a_48_layer_gpt2_renders_every_node(page, tmp_path):
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.config import ModelConfig

    # gpt2, 48 layers, unfused attention. One sdpa block has 43 nodes: 12 AccumulateGrad + 4 Addmm + 4 T
    # for its four Linears, 12 View (2 per Linear, q/k/v heads, the merged output), 4 Transpose, 1 Split,
    # the fused attention node, 2 LayerNorm, 1 GELU, 2 residual Add. Unfused attention adds 19 (see
    # test_capture): 62 per layer. Outside the blocks, 15: NllLoss, LogSoftmax, View (loss); UnsafeView,
    # Mm, View, T (lm_head); LayerNorm + 2 AccumulateGrad (ln_f); Add, 2 Embedding, 2 AccumulateGrad.
    capture = capture_backward(ModelConfig(model="gpt2", layers=48, attention="manual", device="meta"))
    assert capture.summary.nodes == 62 * 48 + 15
    path = tmp_path / "deep.html"
    path.write_text(render_html(capture.graph))
    page.goto(path.as_uri())
    wait_until_drawn(page, 60_000)
    assert page.evaluate("window.network.body.data.nodes.length") == capture.summary.nodes


def test_a_page_url_as_the_first_request_still_goes_through_the_apps_navigation(page):
    # A fresh server, and the very first request is /toy_expressions: Streamlit would run the page file on
    # its own (legacy pages/ mode); graphviz_core.ui.navigation reruns it through app.py's st.navigation.
    from graphviz_core.ui.browser_harness import serve_app

    with serve_app({"GRAPHVIZ_CORE_DEVICE": "cpu"}) as url:
        page.goto(f"{url}/toy_expressions")
        page.get_by_text("Backprop, one value at a time").wait_for(timeout=60_000)
        nav = page.locator('[data-testid="stSidebarNav"]')
        nav.get_by_text("Graph explorer").wait_for(timeout=30_000)
        assert nav.get_by_text("Toy expressions").count() == 1
        assert nav.get_by_text("app", exact=True).count() == 0  # the legacy list would name app.py "app"
        page.goto("about:blank")  # before this server stops: its lazily loaded scripts would fail to load


def test_toy_expression_page_requests_only_localhost_and_draws(page, streamlit_url):
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(f"{streamlit_url}/toy_expressions")
    # "Transformer Math"'s graph: L, e, d and the variables a, b, c = 6 nodes
    frame = graph_frame(page, 6)
    page.get_by_text("Next ›").click()
    page.wait_for_timeout(1500)
    frame = graph_frame(page, 6)
    labels = frame.evaluate("window.network.body.data.edges.get().map(e => e.label || '')")
    assert "8" in labels  # after step 1 (L's backward), L -> e carries dL/de = 2e = 8
    hosts = {urlparse(u).hostname for u in requests if urlparse(u).scheme in ("http", "https", "ws", "wss")}
    assert hosts <= {"127.0.0.1", "localhost"}, hosts


def test_hovering_a_node_shows_its_tooltip_and_leaving_hides_it_without_errors(page, streamlit_url, tmp_path):
    # The tooltip used to live inside the container vis-network empties: every hover threw a TypeError and
    # every leave another; the page fixture fails the test on any page error or console error.
    capture = captured("gpt2-tiny")
    node = next(n for n, d in capture.graph.nodes(data=True) if d["category"] == "loss")
    page.goto(streamlit_url)
    frame = graph_frame(page, capture.summary.nodes)
    text = hover_and_leave(page, frame, node)
    assert "category: loss" in text
    assert page.errors == []
    # The downloaded standalone page: same template, opened from disk.
    path = tmp_path / "standalone.html"
    path.write_text(render_standalone_html(capture))
    page.goto(path.as_uri())
    wait_until_drawn(page, 30_000)
    assert "category: loss" in hover_and_leave(page, page.main_frame, node)
