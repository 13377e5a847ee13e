"""Downloads in a real browser: "this view" holds what the screen shows, and downloading keeps the view."""

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from graphviz_core.ui.browser_harness import graph_frame
from tests.conftest import captured, choose, idle

pytestmark = pytest.mark.browser


def drawn_frame(page, nodes: int, text: str, timeout_ms: int = 60_000):
    """The graph frame that drew `nodes` nodes and whose side panel shows `text` (the view just asked for)."""
    deadline = page.evaluate("Date.now()") + timeout_ms
    while page.evaluate("Date.now()") < deadline:
        frame = graph_frame(page, nodes)
        try:
            if text in frame.locator("#side").inner_text(timeout=1_000):
                return frame
        except Exception:  # noqa: BLE001 - the frame was replaced while we read it
            pass
        page.wait_for_timeout(250)
    raise TimeoutError(f"no frame drew {nodes} nodes with {text!r}")


def download(page, row: str, label: str, binary: bool = False) -> str | bytes:
    """Click `label` in the "view" or "whole" row of download buttons; the file's text (or bytes).

    Once the app has been idle a second. Streamlit gives each button's file a new id on every rerun and drops the old
    one when the run ends, so a click that reaches the server after a rerun it had not yet drawn gets nothing (a CI
    run's server log: "Deferred file ... not found", and no download in 90 s); as a person would, click again."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(3):
        idle(page, settle_ms=1_000)
        try:
            with page.expect_download(timeout=30_000) as info:
                page.locator(f".st-key-downloads-{row}").get_by_role("button", name=label, exact=True).click()
            break
        except PlaywrightTimeout:
            if attempt == 2:
                raise
    path = Path(info.value.path())
    return path.read_bytes() if binary else path.read_text()


KEPT = "[window.__kept, window.network.getScale(), window.network.getSelectedNodes()]"


def test_downloads_offer_this_view_and_the_whole_graph_and_keep_zoom_and_selection(page, streamlit_url):
    capture = captured("gpt2-tiny")
    page.goto(streamlit_url)
    graph_frame(page, capture.summary.nodes)
    page.get_by_text("Hide shape ops").click()
    graph_frame(page, 101 - 46)  # gpt2-tiny: 101 nodes, 46 of them shape ops (test_browser)
    page.get_by_text("Collapse modules").click()
    # 6 module nodes (blocks.0, blocks.1, wte, wpe, ln_f, lm_head) + the 3 non-shape nodes outside every
    # module (NllLoss, LogSoftmax, the wte + wpe Add; the View before the loss is hidden) = 9 of 101
    graph_frame(page, 9)
    choose(page, page.get_by_role("combobox", name="Colour by", exact=True), "FLOPs")
    frame = drawn_frame(page, 9, "colour: FLOPs")
    ids = frame.evaluate("window.network.body.data.nodes.getIds()")
    fills = frame.evaluate("Object.fromEntries(window.network.body.data.nodes.get().map(n => [n.id, n.color.background]))")
    loss = next(n for n in ids if capture.graph.nodes[n]["category"] == "loss") if any(
        n in capture.graph and capture.graph.nodes[n]["category"] == "loss" for n in ids) else ids[0]
    # Zoom, select, and leave a mark in the iframe's window: a re-rendered iframe would lose all three.
    frame.evaluate("id => { window.network.moveTo({position: {x: 0, y: 0}, scale: 1.7, animation: false});"
                   " window.network.selectNodes([id]); window.__kept = 'kept'; }", loss)
    assert frame.evaluate(KEPT) == ["kept", 1.7, [loss]]

    view = json.loads(download(page, "view", "JSON"))
    assert sorted(n["id"] for n in view["graph"]["nodes"]) == sorted(ids)
    assert view["view"]["nodes"] == 9 and view["view"]["hide_shape"] and view["view"]["collapse"]
    assert view["view"]["colour_by"] == "flops"
    assert view["summary"]["nodes"] == 101  # the summary still describes the whole capture
    dot = download(page, "view", "DOT")
    # every node filled as the screen fills it (the FLOP scale, not the category colours)
    dot_fills = dict(re.findall(r'^  "([^"]+)" \[label=.*?fillcolor="(#[0-9a-f]{6})"', dot, re.M))
    assert dot_fills == fills
    assert download(page, "view", "GraphML").count("<node ") == 9
    html = download(page, "view", "HTML")
    assert html.count('"shape":"box"') + html.count('"shape":"ellipse"') == 9
    svg = download(page, "view", "SVG")
    assert svg.count('class="node"') == 9 and "colour: FLOPs" in svg
    png = Image.open(io.BytesIO(download(page, "view", "PNG", binary=True)))
    # PNG_SIZE 1600x1000 CSS pixels at PNG_SCALE 2 -> 3200x2000 device pixels
    assert png.size == (3200, 2000)
    rgb = np.asarray(png.convert("RGB")).astype(int)
    # The biggest FLOP nodes (the two blocks) are filled with the scale's darkest colour, #a50026 = (165, 0, 38):
    # the picture is this view coloured by FLOPs, not the category colours.
    dark_red = (np.abs(rgb - [165, 0, 38]).sum(axis=2) < 12).sum()
    assert dark_red > 2000, dark_red
    page.wait_for_timeout(1500)  # time for any rerun the clicks might have started
    assert frame.evaluate(KEPT) == ["kept", 1.7, [loss]]

    whole = json.loads(download(page, "whole", "JSON"))
    assert len(whole["graph"]["nodes"]) == 101 and "view" not in whole
    assert download(page, "whole", "GraphML").count("<node ") == 101
    page.wait_for_timeout(1500)
    assert frame.evaluate(KEPT) == ["kept", 1.7, [loss]]
    assert len(page.frames) == 2  # the page and the one graph iframe, not a second one beside it
