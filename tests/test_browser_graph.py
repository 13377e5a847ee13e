"""The standalone graph page in headless Chromium: metric colour scale, readable labels, big-graph views."""

import pytest

from graphviz_core.render import render_html
from tests.conftest import captured

pytestmark = pytest.mark.browser

SIZES = ((1280, 800), (1920, 1080))


def open_graph(page, tmp_path, html: str, width: int = 1280, height: int = 800):
    page.set_viewport_size({"width": width, "height": height})
    path = tmp_path / "graph.html"
    path.write_text(html)
    page.goto(path.as_uri())
    page.wait_for_function("window.__firstDrawMs !== undefined", timeout=60_000)


def whole_on_screen(page, selector: str, width: int, height: int) -> bool:
    box = page.locator(selector).bounding_box()
    return box is not None and box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= width \
        and box["y"] + box["height"] <= height


@pytest.mark.parametrize("width, height", SIZES)
def test_colour_by_flops_shows_the_scale_whole_and_light_text_on_the_darkest_fill(page, tmp_path, width, height):
    graph = captured("gpt2-tiny").graph
    open_graph(page, tmp_path, render_html(graph, colour_by="flops"), width, height)
    assert page.locator("#legend").count() == 0
    # lm_head's Mm backward is the biggest: 2 * 2*64*512*64 = 8,388,608 FLOP (see test_render); views run none.
    assert page.locator("#scale-min").inner_text() == "0 FLOP"
    assert page.locator("#scale-max").inner_text() == "8.4 MFLOP"
    for end in ("#scale-min", "#scale-mid", "#scale-max"):
        assert whole_on_screen(page, end, width, height), end
    page.screenshot(path=tmp_path / f"flops-{width}.png")
    darkest = max(graph.nodes, key=lambda n: graph.nodes[n]["flops"])
    drawn = page.evaluate("id => { const o = window.network.body.nodes[id].options;"
                          " return [o.color.background, o.font.color]; }", darkest)
    assert drawn == ["#a50026", "#ffffff"]  # the heat scale's dark red end, white text on it
