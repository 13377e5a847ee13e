"""Compare mode in a real browser: the sdpa vs manual pair reads +19 nodes per layer and both graphs draw."""

from urllib.parse import urlparse

import pytest

from graphviz_core.ui.browser_harness import graph_frame
from tests.conftest import captured

pytestmark = pytest.mark.browser


def test_compare_mode_reads_plus_19_nodes_per_layer_and_draws_b(page, streamlit_url):
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(streamlit_url)
    page.locator('[data-testid="stSidebarNav"]').get_by_text("Compare two configs").click()
    metric = page.locator('[data-testid="stMetric"]').filter(has_text="Nodes per layer")
    metric.wait_for(timeout=90_000)
    # manual attention spells out 20 nodes per layer where sdpa has 1 fused node: +19 (tests/test_compare.py)
    assert metric.locator('[data-testid="stMetricValue"]').inner_text() == "+19"
    page.get_by_text("+19 nodes per layer (+38 in all)").first.wait_for(timeout=10_000)
    # B's graph (the open tab) draws every node of the manual-attention capture: 101 + 2 layers x 19 = 139
    b = captured("gpt2-tiny", attention="manual")
    frame = graph_frame(page, b.summary.nodes)
    assert b.summary.nodes == 139
    assert frame.evaluate("Object.keys(window.network.getPositions()).length") == 139
    # nodes only in B carry the pink highlight border: 2 layers x 20 spelled-out attention nodes = 40
    pink = "window.network.body.data.nodes.get().filter(n => n.color && n.color.border === '#e6007e').length"
    assert frame.evaluate(pink) == 40
    # the per-op and per-module tables each take the page's width (side by side at 1500 px and less, the op names
    # were cut: "ScaledDotProductFlashAtten…")
    tables = page.locator('[data-testid="stDataFrame"]')
    main = page.locator('[data-testid="stMainBlockContainer"]').evaluate("e => e.clientWidth")
    for caption in ("Per op (only ops", "Per module (only modules"):
        table = page.get_by_text(caption).locator("xpath=following::*[@data-testid='stDataFrame'][1]")
        assert table.evaluate("e => e.clientWidth") > 0.8 * main, caption
    assert tables.count() >= 2
    hosts = {urlparse(u).hostname for u in requests if urlparse(u).scheme in ("http", "https", "ws", "wss")}
    assert hosts <= {"127.0.0.1", "localhost"}, hosts
    assert not errors, errors
