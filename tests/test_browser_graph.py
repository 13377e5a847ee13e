"""The standalone graph page in headless Chromium: metric colour scale, readable labels, big-graph views."""

import pytest

from graphviz_core.export.formats import wait_until_drawn
from graphviz_core.export.render import render_html
from tests.conftest import SIZES, captured

pytestmark = pytest.mark.browser



def open_graph(page, tmp_path, html: str, width: int = 1280, height: int = 800):
    page.set_viewport_size({"width": width, "height": height})
    path = tmp_path / "graph.html"
    path.write_text(html)
    page.goto(path.as_uri())
    wait_until_drawn(page, 60_000)


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


def gpt2_small_graph():
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.config import config_from_preset

    return capture_backward(config_from_preset("gpt2-small", device="meta")).graph  # shapes only: instant


@pytest.mark.parametrize("width, height", SIZES)
def test_fit_all_on_gpt2_small_fills_the_pane_at_a_usable_scale(page, tmp_path, width, height):
    graph = gpt2_small_graph()
    open_graph(page, tmp_path, render_html(graph), width, height)
    page.locator("#fit").click()
    scale, filled = page.evaluate("""() => {
        const net = window.network, box = document.getElementById('graph');
        const ids = net.body.data.nodes.getIds();
        let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
        for (const id of ids) {
            const b = net.getBoundingBox(id);
            const a = net.canvasToDOM({x: b.left, y: b.top}), c = net.canvasToDOM({x: b.right, y: b.bottom});
            x0 = Math.min(x0, a.x); y0 = Math.min(y0, a.y); x1 = Math.max(x1, c.x); y1 = Math.max(y1, c.y);
        }
        return [net.getScale(), [(x1 - x0) / box.clientWidth, (y1 - y0) / box.clientHeight]];
    }""")
    page.screenshot(path=tmp_path / f"fit-{width}.png")
    # One column of 286 layers x 80 px = 22,880 px fitted into a 760 px pane was scale 0.033, ~20% of the
    # width used. Folded: at least 5x that scale, one side of the pane filled and at least half the other.
    assert scale >= 0.15, scale
    assert max(filled) >= 0.9 and min(filled) >= 0.5, filled


def test_search_opens_on_the_first_match_and_next_match_moves_on(page, tmp_path):
    from graphviz_core.graph.views import search_nodes

    graph = gpt2_small_graph()
    matches = search_nodes(graph, "blocks.5.attn.qkv")
    assert len(matches) == 6  # one Linear: Addmm, input and output Views, T, weight, bias
    open_graph(page, tmp_path, render_html(graph, highlight=matches))
    order = page.evaluate("JSON.parse(document.getElementById('graph-data').textContent).matches")
    for i, node in enumerate(order[:2]):
        if i:
            page.locator("#next-match").click()
            assert page.locator("#match-count").inner_text() == "match 2 of 6"
            assert node in page.locator("#details").inner_text()
        centre = page.evaluate("window.network.getViewPosition()")
        where = page.evaluate("id => window.network.getPosition(id)", node)
        assert abs(centre["x"] - where["x"]) < 1 and abs(centre["y"] - where["y"]) < 1, (node, centre, where)
        assert page.evaluate("window.network.getScale()") >= 0.8  # labels drawn at 13 px x 0.8 = 10 px


def redraw(page):
    """Ask vis-network for a frame and wait until it has been drawn."""
    page.evaluate("() => new Promise((done) => { window.network.once('afterDrawing', () => done()); window.network.redraw(); })")


def arrowheads_drawn(page, edge_id: str) -> int:
    """How many times one edge's arrowhead is drawn in one frame, drawn synchronously (a spy on that edge)."""
    return page.evaluate("""id => { const edge = window.network.body.edges[id]; let calls = 0;
        const real = edge.drawArrows; edge.drawArrows = function () { calls += 1; return real.apply(this, arguments); };
        window.network.redraw(); edge.drawArrows = real; return calls; }""", edge_id)


def test_zoomed_out_the_overview_drops_arrowheads_but_keeps_searched_and_selected_labels(page, tmp_path):
    from graphviz_core.graph.views import search_nodes

    graph = gpt2_small_graph()
    matches = search_nodes(graph, "blocks.5.attn.qkv")
    open_graph(page, tmp_path, render_html(graph, highlight=matches))
    first = page.evaluate("JSON.parse(document.getElementById('graph-data').textContent).matches[0]")
    edge = page.evaluate("id => window.network.getConnectedEdges(id)[0]", first)
    # opened on the first match at scale 0.8: labels are drawn (13 px x 0.8 = 10.4 px) and arrowheads too
    assert page.evaluate("window.levelOfDetail.active && !window.levelOfDetail.overview()")
    assert arrowheads_drawn(page, edge) == 1
    page.locator("#fit").click()
    # Fit all: scale ~0.16, labels would be 2 px, under the 4.85 px floor (LABEL_DRAW_THRESHOLD - 1): the overview
    assert page.evaluate("window.levelOfDetail.overview()")
    assert arrowheads_drawn(page, edge) == 0
    assert page.evaluate("window.levelOfDetail.cached()")  # the plain drawing comes from one bitmap
    labelled = page.evaluate("window.levelOfDetail.labelled")
    assert first in labelled and set(labelled) <= matches
    # a node that is neither searched nor near a match: once selected, its label is written first
    other = next(n for n in graph if graph.nodes[n]["module"].startswith("blocks.9.mlp"))
    page.evaluate("id => window.network.selectNodes([id])", other)
    redraw(page)
    assert page.evaluate("window.levelOfDetail.labelled")[0] == other
    # and the writing is on the page: dark text pixels just right of the node
    x, y = page.evaluate("""id => { const n = window.network.body.nodes[id];
        const p = window.network.canvasToDOM({x: n.shape.boundingBox.right, y: n.y}); return [p.x, p.y]; }""", other)
    box = page.locator("#graph").bounding_box()
    shot = page.screenshot(clip={"x": box["x"] + x + 2, "y": box["y"] + y - 14, "width": 90, "height": 28})
    assert dark_pixels(shot) > 40, dark_pixels(shot)


def dark_pixels(png: bytes) -> int:
    import io

    from PIL import Image

    return sum(Image.open(io.BytesIO(png)).convert("L").histogram()[:90])  # grey levels 0..89


def test_without_level_of_detail_every_arrowhead_is_drawn_zoomed_out(page, tmp_path):
    graph = gpt2_small_graph()
    open_graph(page, tmp_path, render_html(graph, level_of_detail=False))
    page.locator("#fit").click()
    edge = page.evaluate("window.network.body.data.edges.getIds()[0]")
    assert page.evaluate("!window.levelOfDetail.active")
    assert arrowheads_drawn(page, edge) == 1


# Pixels of the graph's canvas that are not (near) white: what is drawn (transparent where nothing is drawn).
INK = """(canvas) => {
    const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
    let count = 0;
    for (let i = 0; i < pixels.length; i += 4) {
        if (pixels[i + 3] > 128 && pixels[i] + pixels[i + 1] + pixels[i + 2] < 720) count += 1;
    }
    return count;
}"""

INK_WHILE = """async (action) => {
    const net = window.network, canvas = document.querySelector('#graph canvas');
    const frame = () => new Promise((done) => requestAnimationFrame(() => done()));
    const ink = () => (""" + INK + """)(canvas);
    await frame(); await frame();
    const still = ink();
    const box = canvas.getBoundingClientRect();
    if (action === 'wheel') {
        canvas.dispatchEvent(new WheelEvent('wheel', {deltaY: -1, clientX: box.left + box.width / 2,
                                                       clientY: box.top + box.height / 2, bubbles: true, cancelable: true}));
    } else {
        net.body.emitter.emit('dragStart', {nodes: []});  // what vis-network's own pan handler announces
        net.moveTo({position: {x: net.getViewPosition().x + 30, y: net.getViewPosition().y}, animation: false});
    }
    await frame(); await frame();
    const flag = action === 'wheel' ? net.renderer.zooming : net.renderer.dragging;
    const moving = ink();
    if (action !== 'wheel') net.body.emitter.emit('dragEnd', {nodes: []});
    return [flag, still, moving];
}"""


@pytest.mark.parametrize("action", ["wheel", "drag"])
def test_the_overview_stays_drawn_while_zooming_or_dragging(page, tmp_path, action):
    # vis-network skips edges while the view is zoomed or dragged (hideEdgesOnZoom/Drag); the overview's
    # bitmap holds nodes and edges, so it must not go with them.
    open_graph(page, tmp_path, render_html(gpt2_small_graph()))
    page.locator("#fit").click()
    assert page.evaluate("window.levelOfDetail.overview()")
    flag, still, moving = page.evaluate(INK_WHILE, action)
    assert flag is True  # measured while vis-network still counts the view as moving
    assert moving > 0.8 * still, (still, moving)


INK_NOW = """async () => {
    const canvas = document.querySelector('#graph canvas');
    await new Promise((done) => { window.network.once('afterDrawing', () => done()); window.network.redraw(); });
    return (""" + INK + """)(canvas);
}"""


@pytest.mark.parametrize("size_by", [None, "flops"])
def test_the_overview_draws_about_as_much_as_the_full_drawing(page, tmp_path, size_by):
    # Same graph, same fitted view: the plain overview and vis-network's full drawing cover a similar area: no
    # arrowheads or labels in the overview, landmarks added, and edges at least 0.8 px wide where vis-network's
    # 1-unit lines fade to 0.16 px (size by FLOPs, where nodes are small dots: 2.3x the ink). A dot drawn over
    # its label's box as well was 24x.
    graph = gpt2_small_graph()
    ink = {}
    for lod in (False, True):
        open_graph(page, tmp_path, render_html(graph, size_by=size_by, level_of_detail=lod))
        page.locator("#fit").click()
        ink[lod] = page.evaluate(INK_NOW)
    assert 0.5 < ink[True] / ink[False] < 3, ink


def test_zoomed_out_block_names_never_overlap(page, tmp_path):
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.config import ModelConfig

    # 48 blocks in 16 columns of 3: fitted at 1280x800 a column is ~55 px wide, "blocks.44" in bold 13 px ~65
    graph = capture_backward(ModelConfig(model="gpt2", layers=48, attention="manual", device="meta")).graph
    open_graph(page, tmp_path, render_html(graph))
    page.locator("#fit").click()
    redraw(page)
    boxes = page.evaluate("window.landmarksShown")
    assert len(boxes) >= 48 // 2  # at least every other block keeps its name
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            apart = a["right"] <= b["left"] or b["right"] <= a["left"] or a["bottom"] <= b["top"] or b["bottom"] <= a["top"]
            assert apart, (a, b)


def test_labels_are_whole_at_the_zoom_a_png_is_taken_at(page, tmp_path):
    from graphviz_core.export.formats import MIN_FIT_SCALE

    # to_png photographs a graph too big to fit readably at MIN_FIT_SCALE (0.45): labels 13 x 0.45 = 5.85 px,
    # drawn whole there (vis-network fades them only below its drawThreshold), not the label-less overview
    graph = gpt2_small_graph()
    open_graph(page, tmp_path, render_html(graph))
    page.evaluate("s => window.network.moveTo({scale: s, animation: false})", MIN_FIT_SCALE)
    redraw(page)
    assert not page.evaluate("window.levelOfDetail.overview()")
    node = page.evaluate("window.network.body.nodeIndices.find(id => { const p = window.network.canvasToDOM("
                         "window.network.getPosition(id)); return p.x > 0 && p.y > 0 && p.x < 900 && p.y < 700; })")
    visible, alpha = page.evaluate("""id => { const label = window.network.body.nodes[id].labelModule;
        const size = label.fontOptions.size * window.network.getScale();
        const threshold = label.elementOptions.scaling.label.drawThreshold;
        return [label.visible(), Math.max(0, Math.min(1, 1 - (threshold - size)))]; }""", node)
    assert visible and alpha >= 0.999  # vis-network's fade: 1 - (drawThreshold - px), at most 1


def click_node(page, node: str) -> None:
    """Click `node` where it is drawn (brought into view at scale 1 first), as a person would."""
    from tests.test_browser import node_point

    page.evaluate("id => window.network.focus(id, {scale: 1.0, animation: false})", node)
    redraw(page)
    x, y = node_point(page.main_frame, node)
    page.mouse.click(x, y)
    page.locator("#details table").wait_for(timeout=5_000)


@pytest.mark.parametrize("width, height", SIZES)
def test_the_details_panel_gives_values_room_and_nothing_overflows(page, tmp_path, width, height):
    # The loss node's rows include "gradient norm (all gradients it sends to its inputs, combined)": kept on
    # one line it took ~280 of the 300 px panel and left its value column ~19 px wide.
    graph = captured("gpt2-tiny").graph
    loss = next(n for n, d in graph.nodes(data=True) if d["category"] == "loss")
    open_graph(page, tmp_path, render_html(graph), width, height)
    click_node(page, loss)
    page.screenshot(path=tmp_path / f"details-{width}.png")
    panel, cells = page.evaluate("""() => {
        const side = document.getElementById('side');
        const cells = [...document.querySelectorAll('#details td')].map(td => {
            const r = td.getBoundingClientRect();
            return {text: td.textContent, width: r.width, right: r.right, scroll: td.scrollWidth, client: td.clientWidth};
        });
        return [{width: side.clientWidth, right: side.getBoundingClientRect().left + side.clientWidth,
                 scroll: side.scrollWidth}, cells];
    }""")
    assert panel["scroll"] <= panel["width"], panel  # no horizontal scrolling in the side panel
    values = cells[1::2]
    assert len(values) >= 8  # id, op, category, module, saved bytes, FLOPs, time, gradient norm at least
    for cell in values:
        assert cell["width"] >= 0.45 * panel["width"], (cell, panel)
    for cell in cells:
        assert cell["scroll"] <= cell["client"] and cell["right"] <= panel["right"] + 0.5, (cell, panel)


DOTS_OVER_LABELS = """() => {
    const net = window.network, ctx = net.canvas.getContext();
    const ids = net.body.nodeIndices, nodes = ids.map(id => net.body.nodes[id]);
    net.moveTo({scale: 1, animation: false});  // every label drawable (13 px), wherever it is
    nodes.forEach(n => { const d = n.draw(ctx); if (d && d.drawExternalLabel) { d.drawExternalLabel(); } });  // places each label
    net.redraw();
    const hits = [];
    for (const dot of nodes) {
        for (const other of nodes) {
            const l = other.labelModule.size;  // the label's box, canvas units
            const nx = Math.max(l.left, Math.min(dot.x, l.left + l.width)), ny = Math.max(l.top, Math.min(dot.y, l.top + l.height));
            if (Math.hypot(dot.x - nx, dot.y - ny) < dot.options.size) { hits.push([dot.id, other.id]); }
        }
    }
    return hits;
}"""


def test_sized_by_flops_no_dot_covers_a_label(page, tmp_path):
    # Radius 6 + 40 * t reached 46 px, more than half the 80 px between layers: lm_head's Mm dot covered the
    # label of the UnsafeView above it, and the label under each big Addmm ran into the next row's dots.
    graph = captured("gpt2-tiny").graph
    open_graph(page, tmp_path, render_html(graph, size_by="flops"))
    page.locator("#fit").click()
    redraw(page)
    page.screenshot(path=tmp_path / "size-flops.png")  # looked at: dots and labels apart
    assert page.evaluate(DOTS_OVER_LABELS) == []
    sizes = page.evaluate("window.network.body.nodeIndices.map(id => window.network.body.nodes[id].options.size)")
    assert max(sizes) >= 3 * min(sizes)  # still visibly sized by FLOPs


def test_clicking_a_node_hides_its_tooltip(page, tmp_path):
    # The tooltip covered the graph beside the node it described after a click showed the same rows in the panel.
    from tests.test_browser import node_point

    graph = captured("gpt2-tiny").graph
    loss = next(n for n, d in graph.nodes(data=True) if d["category"] == "loss")
    open_graph(page, tmp_path, render_html(graph))
    page.evaluate("id => window.network.focus(id, {scale: 1.0, animation: false})", loss)
    redraw(page)
    x, y = node_point(page.main_frame, loss)
    page.mouse.move(x - 40, y - 40)
    page.mouse.move(x, y, steps=5)
    page.locator("#tip").wait_for(state="visible", timeout=5_000)
    page.mouse.click(x, y)
    page.locator("#details table").wait_for(timeout=5_000)
    page.wait_for_timeout(300)  # vis-network's hover events arrive after a tooltipDelay of 120 ms
    assert not page.locator("#tip").is_visible()


def test_the_png_of_a_search_shows_no_buttons(tmp_path):
    import io

    from PIL import Image

    from graphviz_core.export.formats import PNG_SCALE, PNG_SIZE, to_png
    from graphviz_core.graph.views import search_nodes

    graph = captured("gpt2-tiny").graph
    png = to_png(render_html(graph, highlight=search_nodes(graph, "mlp.fc"), height_px=PNG_SIZE[1]))
    (tmp_path / "search.png").write_bytes(png)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    # Chromium's button face is rgb(239, 239, 239): "Next match" (~80 x 22 CSS px, ~7,000 device pixels at 2x)
    # was left in the side panel (the right 310 CSS px); the graph's own greys are other shades.
    side = image.crop(((PNG_SIZE[0] - 310) * PNG_SCALE, 0, image.width, image.height))
    face = sum(1 for pixel in zip(*(band.tobytes() for band in side.split()), strict=True) if pixel == (239, 239, 239))
    assert face < 200, face


@pytest.mark.parametrize("start", ["opened", "fit", "zoomed-in elsewhere"])
def test_zoom_to_the_loss_puts_it_at_the_top_at_scale_1(page, tmp_path, start):
    # Nothing lies above the loss: centred, it left the upper half of the pane empty (loss at y 379 of 758 px).
    # At the top (its centre 40 px down) the first steps of the backward pass fill the pane below it.
    graph = gpt2_small_graph()
    open_graph(page, tmp_path, render_html(graph))
    if start == "fit":
        page.locator("#fit").click()
    elif start == "zoomed-in elsewhere":
        far = next(n for n in graph if graph.nodes[n]["module"].startswith("blocks.9"))
        page.evaluate("id => window.network.focus(id, {scale: 2.5, animation: false})", far)
    page.locator("#top").click()
    redraw(page)
    scale, at, width = page.evaluate("""id => [window.network.getScale(),
        window.network.canvasToDOM(window.network.getPosition(id)), document.getElementById('graph').clientWidth]""",
                                     "NllLossBackward0:0")
    assert scale == 1.0  # 13 px labels at 13 px
    assert abs(at["x"] - width / 2) < 1 and abs(at["y"] - 40) < 1, at


@pytest.mark.parametrize("width, height", SIZES)
def test_a_compiled_graph_opens_with_the_loss_and_the_compiled_node_in_view(page, tmp_path, width, height):
    # gpt2-tiny compiled: loss, log-softmax, a view, one compiled node, then its 28 parameters in one row far wider
    # than the pane. The first view started at that row's left edge: three parameter ovals, the loss pages away.
    graph = captured("gpt2-tiny", compile=True).graph
    (compiled,) = [n for n, d in graph.nodes(data=True) if d["op"] == "CompiledFunctionBackward"]
    open_graph(page, tmp_path, render_html(graph), width, height)
    redraw(page)
    pane = page.evaluate("[document.getElementById('graph').clientWidth, document.getElementById('graph').clientHeight]")
    for node in ("NllLossBackward0:0", compiled):
        at = page.evaluate("id => window.network.canvasToDOM(window.network.getPosition(id))", node)
        assert 0 < at["x"] < pane[0] and 0 < at["y"] < pane[1], (node, at, pane)
    at = page.evaluate("id => window.network.canvasToDOM(window.network.getPosition(id))", "NllLossBackward0:0")
    assert abs(at["y"] - 40) < 1  # at the top, as the caption says: "from the loss (top)"
    page.screenshot(path=tmp_path / f"compiled-first-view-{width}x{height}.png")
