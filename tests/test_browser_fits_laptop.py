"""The page fits a laptop's first screen: each title near the top, and a graph's first view cuts no node at its edge
(a node cut at the right edge reads as hidden under the legend column beside it)."""

import pytest

from graphviz_core.export.formats import wait_until_drawn
from graphviz_core.export.render import render_standalone_html
from graphviz_core.ui.browser_harness import graph_frame
from tests.conftest import LAPTOP, SIZES, at_laptop, captured, each_size, idle, settled

pytestmark = pytest.mark.browser

TITLES = {"": "Inside the backward pass", "/compare": "Compare two configs",
          "/toy_expressions": "Backprop, one value at a time", "/parallel": "Beyond one GPU"}
TITLE_TOP_PX = 60  # the title's first line of text, from the top of the window (Streamlit's default put it at 125)

# Nodes that the graph's pane shows only in part: their drawn box (label included) crosses the pane's edge.
CUT_NODES = """() => {
  const net = window.network, pane = document.getElementById("graph");
  const width = pane.clientWidth, height = pane.clientHeight, cut = [];
  for (const id of net.body.nodeIndices) {
    const box = net.getBoundingBox(id);
    const a = net.canvasToDOM({x: box.left, y: box.top}), b = net.canvasToDOM({x: box.right, y: box.bottom});
    const seen = a.x < width && b.x > 0 && a.y < height && b.y > 0;
    if (seen && (a.x < 0 || b.x > width || a.y < 0 || b.y > height)) { cut.push(id); }
  }
  return cut;
}"""
# Nodes drawn (any part) right of where the side panel with the legend begins.
UNDER_LEGEND = """() => {
  const net = window.network, side = document.getElementById("side").getBoundingClientRect();
  const pane = document.getElementById("graph").getBoundingClientRect(), under = [];
  for (const id of net.body.nodeIndices) {
    const box = net.getBoundingBox(id);
    const a = net.canvasToDOM({x: box.left, y: box.top}), b = net.canvasToDOM({x: box.right, y: box.bottom});
    const seen = a.y < pane.height && b.y > 0 && a.x < pane.width;
    if (seen && pane.left + b.x > side.left) { under.push(id); }
  }
  return under;
}"""


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_every_page_title_starts_near_the_top(page, streamlit_url, tmp_path):
    # the text itself, not the heading's box (which has padding above the letters); once the page has settled
    text_top = ("() => { const h = document.querySelector('h1'); const r = document.createRange();"
                " r.selectNodeContents(h); return r.getBoundingClientRect().top; }")
    for path, title in TITLES.items():
        at_laptop(page)
        page.goto(f"{streamlit_url}{path}")
        heading = page.get_by_role("heading", name=title, level=1)
        heading.wait_for(timeout=60_000)
        for size in each_size(page):
            try:
                page.wait_for_function(f"() => ({text_top})() <= {TITLE_TOP_PX}", timeout=10_000)
            except Exception:  # noqa: BLE001 - the assertion below says how far down it stayed
                pass
            top = page.evaluate(text_top)
            page.screenshot(path=str(tmp_path / f"title{path.replace('/', '-') or '-explorer'}-{size}.png"))
            assert top <= TITLE_TOP_PX, f"{title!r} starts {top:.0f} px down at {size}"
    page.goto("about:blank")


@pytest.mark.parametrize("page", SIZES, indirect=True)
def test_the_explorers_first_graph_view_cuts_no_node_at_its_edge(page, streamlit_url, tmp_path):
    capture = captured("gpt2-tiny")  # the default: 101 nodes in three columns, too many to fit readably
    page.goto(streamlit_url)
    frame = graph_frame(page, capture.summary.nodes)
    idle(page)
    page.wait_for_timeout(1000)  # Streamlit sizes the frame after its first draw; the view follows
    frame.locator("#graph").scroll_into_view_if_needed()
    page.screenshot(path=str(tmp_path / f"graph-{page.size}.png"))
    assert frame.evaluate(CUT_NODES) == [], f"nodes cut at the pane's edge at {page.size}"
    assert frame.evaluate(UNDER_LEGEND) == []
    # readable: at least the scale whose 13 px labels are drawn whole (render.MIN_FIT_SCALE)
    assert frame.evaluate("window.network.getScale()") >= 0.45


@pytest.mark.parametrize("page", SIZES, indirect=True)
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_an_exported_page_opens_with_no_node_cut_or_under_the_legend(page, tmp_path, preset):
    path = tmp_path / f"{preset}.html"
    path.write_text(render_standalone_html(captured(preset)))
    page.goto(path.as_uri())
    wait_until_drawn(page, 60_000)
    page.screenshot(path=str(tmp_path / f"{preset}-{page.size}.png"))
    assert page.evaluate(CUT_NODES) == [], f"nodes cut at the pane's edge at {page.size}"
    assert page.evaluate(UNDER_LEGEND) == [], f"nodes under the legend column at {page.size}"


# Tables wider than what shows of them: a data grid whose columns run past its right edge, or an st.table wider than
# its column (both were cut at 1280 px: the FLOPs tab's node tables, Beyond one GPU's collectives). Run on one table
# once it is drawn; returns "" when it fits.
OVERFLOWING_TABLE = """(e) => {
  const box = e.getBoundingClientRect(), column = e.parentElement.getBoundingClientRect();
  const grid = e.querySelector('.dvn-scroller'), table = e.querySelector('table');
  const content = grid ? grid.scrollWidth : table.getBoundingClientRect().width;
  const shown = grid ? grid.clientWidth : box.width;
  if (content > shown + 1 || box.right > column.right + 1) {
    return `${e.dataset.testid} ${Math.round(content)} px in ${Math.round(shown)}: ${e.innerText.slice(0, 60)}`;
  }
  return "";
}"""
TABLE_PAGES = [  # path, a text the page shows once drawn, the tab to open
    ("/?tab=FLOPs+and+time", "Forward FLOPs", None),
    ("/?tab=FLOPs+and+time&preset=llama-tiny", "Forward FLOPs", None),  # long module paths
    ("/?tab=Memory", "Activation peak", None),
    ("/parallel", "Rank 0 next to one device", None),
    ("/parallel", "Rank 0 next to one device", "Communication in backward"),
]


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_no_result_table_runs_past_its_right_edge(page, streamlit_url, tmp_path):
    """Each page loaded once at a laptop's size and checked there, then at a desktop's once its columns are laid out
    again for the wider window."""
    for path, shown, tab in TABLE_PAGES:
        at_laptop(page)
        page.goto(f"{streamlit_url}{path}")
        page.get_by_text(shown).first.wait_for(timeout=120_000)
        if tab:
            page.get_by_role("tab", name=tab).click()
        idle(page)
        # every page here shows a table: wait for the first (the script may still be running before the status widget
        # shows; a loaded fresh-clone run once counted none, which measures nothing)
        tables = page.locator('[data-testid="stDataFrame"], [data-testid="stTable"]')
        tables.filter(visible=True).first.wait_for(timeout=120_000)
        for expander in page.locator('[data-testid="stExpander"] details:not([open]) summary').all():
            if expander.is_visible():  # the lists inside expanders too ("Every node", the forward's collectives)
                expander.click()
        settled(page)
        for size in each_size(page):
            # one table at a time, scrolled into view first: a data frame below the fold draws its grid only once seen
            overflowing = []
            for i in range(tables.count()):
                table = tables.nth(i)
                if not table.is_visible():  # in a closed tab
                    continue
                table.scroll_into_view_if_needed()
                drawn = table.locator(".dvn-scroller, table").first
                try:
                    drawn.wait_for(state="attached", timeout=120_000)  # loaded 2 cores: over 30 s once
                except Exception as error:  # noqa: BLE001 - say which table never drew
                    raise AssertionError(f"{path} {tab or ''} at {size}: table {i} never drew its grid: "
                                         f"{table.inner_text()[:200]!r}") from error
                overflowing.append(table.evaluate(OVERFLOWING_TABLE))
            assert [o for o in overflowing if o] == [], f"{path} {tab or ''} at {size}"
            assert overflowing, f"{path} {tab or ''}: no table seen at {size}"
    page.goto("about:blank")


def test_a_png_of_the_view_with_shape_ops_hidden_reads_top_to_bottom_whole(page, tmp_path):
    import struct

    from graphviz_core.export.formats import MIN_FIT_SCALE, PNG_SCALE, PNG_SIZE
    from graphviz_core.export.render import png_page
    from graphviz_core.ui.graph_view import _png, apply_view

    capture = captured("gpt2-tiny")
    view = apply_view(capture, focus=None, hide_shape=True, collapse=False, expanded=None)
    drawing = dict(title="autograd graph: gpt2-tiny", subtitle="", colour_by=None, size_by=None, highlight=set())
    png = _png(view, drawing)  # the download button's file: headless Chromium photographs the page below
    (tmp_path / "view.png").write_bytes(png)
    html, height = png_page(view, **drawing)
    # 27 layers in one column: (26 x 80 + 60) px x 1.12 (the fit's margin) x 0.5 (the scale it is made for) = 1,199 px
    assert height == 1199
    assert struct.unpack(">II", png[16:24]) == (PNG_SIZE[0] * PNG_SCALE, height * PNG_SCALE)
    # the same page at the picture's size, fitted as the photograph is: one column, each layer below the one before,
    # every node whole at a scale whose labels are drawn
    page.set_viewport_size({"width": PNG_SIZE[0], "height": height})
    (tmp_path / "view.html").write_text(html)
    page.goto((tmp_path / "view.html").as_uri())
    wait_until_drawn(page, 60_000)
    page.evaluate("() => window.network.fit({animation: false})")
    page.screenshot(path=str(tmp_path / "fitted.png"))
    assert page.evaluate("window.network.getScale()") >= MIN_FIT_SCALE
    assert page.evaluate(CUT_NODES) == []
    rows = page.evaluate("""() => { const p = window.network.getPositions(); const ys = {}, xs = [];
        for (const id in p) { ys[p[id].y] = true; xs.push(p[id].x); }
        return [Object.keys(ys).length, Math.max(...xs) - Math.min(...xs)]; }""")
    assert rows[0] == 27  # 27 layers, 27 rows: no layer sits beside another
    assert rows[1] < 1200  # one column's width (it spanned two columns, ~1,900 px, side by side)
