"""The rendered page: self-contained, escaped, one vis node per graph node."""

import json
import re

import networkx as nx
import pytest

from graphviz_core.export.render import VIS_SCRIPT, build_network, node_details, render_html, render_standalone_html
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


def wcag_contrast(a: str, b: str) -> float:
    """WCAG 2.1 contrast ratio, computed here from the spec (not with render's helper)."""
    def luminance(colour: str) -> float:
        r, g, b = (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
        r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b))
        return 0.2126 * r + 0.7152 * g + 0.0722 * b
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def text_between(html: str, element_id: str) -> str:
    return re.search(rf'id="{element_id}">([^<]*)<', html).group(1)


def test_colouring_by_flops_shows_the_scale_in_flop_not_the_category_legend():
    html = render_html(captured("gpt2-tiny").graph, colour_by="flops")
    assert 'id="legend"' not in html and 'id="scale"' in html
    # min: view nodes run no FLOPs. max: lm_head's Mm backward, x (b*s=64, h=64) @ W^T (64, vocab 512):
    # grad_x = 2*64*512*64 = 4,194,304 and grad_W = 2*512*64*64 = 4,194,304, 8,388,608 in all.
    # The colour runs with sqrt, so the bar's middle is min + (max - min) / 4 = 2,097,152.
    assert text_between(html, "scale-min") == "0 FLOP"
    assert text_between(html, "scale-mid") == "2.1 MFLOP"
    assert text_between(html, "scale-max") == "8.4 MFLOP"


@pytest.mark.parametrize("metric, unit", [("time_s", "s"), ("saved_bytes", "B"), ("grad_norm", "")])
def test_every_metric_scale_names_its_unit(metric, unit):
    graph = captured("gpt2-tiny").graph
    html = render_html(graph, colour_by=metric)
    ticks = [text_between(html, f"scale-{end}") for end in ("min", "max")]
    if metric == "saved_bytes":
        # a view saves nothing (0 B); the biggest saved set is the logits' log-softmax output, 64 x 512 fp32
        assert ticks == ["0 B", "128.0 KiB"]
    elif unit:
        assert all(t.endswith(unit) for t in ticks), ticks
    else:
        values = [d["grad_norm"] for _, d in graph.nodes(data=True)]
        assert ticks == [f"{min(values):.4g}", f"{max(values):.4g}"]  # a norm has no unit


def test_labels_stay_readable_on_every_fill():
    # Black or white text, whichever contrasts more, always reaches sqrt(21) = 4.58:1; WCAG asks 4.5 for text.
    graph = captured("gpt2-tiny").graph
    for metric in (None, "flops", "time_s", "saved_bytes", "grad_norm"):
        for node in graph_data(render_html(graph, colour_by=metric))["nodes"]:
            fill = node["color"]["background"]
            assert wcag_contrast(node["font"]["color"], fill) >= 4.5, (metric, node["id"], fill)


def test_a_metric_that_was_not_measured_is_grey_and_said_so():
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.config import config_from_preset

    graph = capture_backward(config_from_preset("gpt2-tiny", device="meta")).graph  # meta runs no kernels: no time
    html = render_html(graph, colour_by="time_s")
    assert 'id="scale-min"' not in html
    assert f"no finite value: {graph.number_of_nodes()} nodes (none measured on this device)" in html
    assert {n["color"]["background"] for n in graph_data(html)["nodes"]} == {"#e0e0e0"}


def test_a_zoomed_out_gpt2_small_names_each_block_once():
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.config import config_from_preset

    graph = capture_backward(config_from_preset("gpt2-small", device="meta")).graph
    marks = [m["text"] for m in graph_data(render_html(graph))["landmarks"]]
    # 12 blocks, each whole in one column (cuts fall between blocks), plus the head and the embeddings
    assert sorted(marks) == sorted([f"blocks.{i}" for i in range(12)] + ["lm_head", "ln_f", "wpe", "wte"])


def test_search_matches_come_in_backward_order():
    from graphviz_core.graph.views import search_nodes

    graph = captured("gpt2-tiny").graph
    matches = search_nodes(graph, "attn.qkv")
    data = graph_data(render_html(graph, highlight=matches))
    # two blocks x one Linear each: Addmm, its input and output Views, T, weight and bias = 6 per block
    assert len(data["matches"]) == 12 and set(data["matches"]) == matches
    distance = nx.single_source_shortest_path_length(graph, next(n for n in graph if graph.in_degree(n) == 0))
    # blocks.1 runs backward first, so its nodes lead (longest path from the loss decides the layer; BFS
    # distance is a lower bound that orders the two blocks the same way)
    assert all(graph.nodes[n]["module"].startswith("blocks.1.") for n in data["matches"][:6])
    assert distance[data["matches"][0]] <= min(distance[n] for n in matches if graph.nodes[n]["module"].startswith("blocks.0."))


def test_level_of_detail_raises_the_label_floor_and_hides_edges_while_zooming():
    graph = captured("mlp", layers=1).graph
    on, off = (graph_data(render_html(graph, level_of_detail=lod)) for lod in (True, False))
    # vis-network fades a label over the pixel below drawThreshold and skips it under drawThreshold - 1. With
    # level of detail the threshold is 13 px x 0.45 = 5.85 px: whole at the PNG's and the opening zoom (0.45),
    # gone under 4.85 px = scale 0.373, where the overview starts; without, vis-network's 5: gone under 4 px.
    assert on["options"]["nodes"]["scaling"]["label"]["drawThreshold"] == pytest.approx(5.85)
    assert off["options"]["nodes"]["scaling"]["label"]["drawThreshold"] == 5
    assert on["lod"]["enabled"] is True and on["lod"]["readable_scale"] == 0.45
    assert on["lod"]["label_scale"] == pytest.approx(4.85 / 13)
    assert off["lod"]["label_scale"] == 4 / 13 and off["lod"]["enabled"] is False
    assert on["options"]["interaction"]["hideEdgesOnZoom"] is True and on["options"]["interaction"]["hideEdgesOnDrag"] is True


def test_a_served_page_loads_vis_network_by_url_and_keeps_only_the_tooltip_style():
    graph = captured("mlp").graph
    inline, served = render_html(graph), render_html(graph, vis_src="/app/static/vis-network.min.js")
    scripts = re.findall(r'<script nonce="([^"]+)" src="([^"]+)"></script>', served)
    assert [src for _, src in scripts] == ["/app/static/vis-network.min.js"]
    assert scripts[0][0] in re.search(r"script-src 'nonce-([^']+)'", served).group(1)  # the CSP lets it run
    # vis-network.min.js (pyvis 4.x's vis-9.1.2) is 468,813 bytes: the served page is that much smaller
    vis_js = VIS_SCRIPT.read_text(encoding="utf-8")
    assert vis_js in inline and vis_js not in served
    assert len(inline) - len(served) > len(vis_js) - 100
    # of vis-network.css (220,163 bytes, three inlined button images of ~28 KB each) only the tooltip rule is kept
    style = re.search(r"<style>(.*?)</style>", served, re.S).group(1)
    assert style.startswith("div.vis-tooltip{") and len(style) < 1000
    assert graph_data(served) == graph_data(inline)


def test_the_subtitle_of_a_vision_model_shows_its_image_size_and_no_sequence_or_attention():
    from graphviz_core.config import config_from_preset
    from graphviz_core.export.render import run_description

    resnet = config_from_preset("resnet-tiny", device="auto")
    subtitle = run_description(resnet, "cpu")
    # the family's own words with the device the capture ran on in place of "auto", then the checkpointing
    assert subtitle == resnet.describe().replace("auto", "cpu") + " · no checkpointing"
    assert f"{resnet.image_size}px" in subtitle and "s=" not in subtitle and "attention" not in subtitle
    assert "sdpa" not in subtitle and "depth 18" in subtitle
    gpt2 = config_from_preset("gpt2-tiny")
    # a language model keeps its sequence length and says which attention ran
    assert f"s={gpt2.seq}" in run_description(gpt2, "cpu") and "sdpa attention (fused)" in run_description(gpt2, "cpu")
    assert run_description(config_from_preset("gpt2-tiny", checkpoint="full"), "cpu").endswith("checkpoint full")


def test_the_description_names_everything_that_produced_the_result():
    from graphviz_core.config import ModelConfig, config_from_preset
    from graphviz_core.export.render import run_description

    # qwen2-tiny selective vs full: the two results differ (Saved + held 503.5 vs 213.5 KiB), so must their lines
    policy = config_from_preset("qwen2-tiny", checkpoint="selective").checkpoint  # the family's own selective
    selective = run_description(config_from_preset("qwen2-tiny", checkpoint=policy), "cpu")
    full = run_description(config_from_preset("qwen2-tiny", checkpoint="full"), "cpu")
    assert selective.endswith(f"· float32 · cpu · sdpa attention (fused) · checkpoint {policy}")
    assert full.endswith("· float32 · cpu · sdpa attention (fused) · checkpoint full")
    eager = run_description(config_from_preset("qwen2-tiny", attention="eager", dtype="bfloat16"), "cpu")
    assert eager.endswith("· bfloat16 · cpu · eager attention (spelled-out) · no checkpointing")
    # a user's own module decides its attention and checkpointing: neither is claimed for it
    assert run_description(ModelConfig(model="custom", preset="net.py:build"), "cpu") == "custom module net.py:build · b=2 · float32 · cpu"


def test_the_side_panel_counts_nodes_and_edges_with_thousands_separators():
    one = captured("mlp", layers=1).graph
    copies = -(-1000 // one.number_of_nodes())  # enough disjoint copies of the MLP's graph to pass 1,000 nodes
    graph = nx.union_all([one] * copies, rename=[f"c{i}." for i in range(copies)])
    nodes, edges = copies * one.number_of_nodes(), copies * one.number_of_edges()
    assert nodes >= 1000
    html = render_html(graph)
    assert f"{nodes:,}</span> nodes · {edges:,} edges" in html  # e.g. "1,008 nodes", not "1008 nodes"


def test_the_view_svg_and_dot_downloads_carry_the_subtitle_under_the_title():
    from graphviz_core.export.formats import CATEGORY_COLOURS, to_dot
    from graphviz_core.export.render import run_description
    from graphviz_core.ui.graph_view import _view_dot_options

    capture = captured("mlp", layers=1)
    subtitle = run_description(capture.config, capture.device)
    drawing = dict(title="autograd graph: mlp", subtitle=subtitle, colour_by=None, size_by=None, highlight=set())
    dot = to_dot(capture.graph, **_view_dot_options(capture.graph, drawing))
    # the legend's rows: the title in bold, then the subtitle (escaped like every label text)
    assert f'<B>autograd graph: mlp</B></TD></TR><TR><TD ALIGN="LEFT">{subtitle}</TD></TR>' in dot
    assert f'<FONT COLOR="{CATEGORY_COLOURS["loss"]}" POINT-SIZE="16">■</FONT> loss' in dot  # a swatch per category
    assert "&lt;b&gt;" in to_dot(capture.graph, title="t", subtitle="<b>")


def test_counts_and_metric_notes_read_as_words():
    """A one-node view says '1 node · 0 edges' (a collapsed focus read '1 nodes'), colour and size notes are
    separated ('colour: … · size: …', which read 'colour: FLOPs size: time'), and a one-layer config says
    '1 layer'."""
    from graphviz_core.config import config_from_preset
    from graphviz_core.export.render import METRICS, render_html

    graph = captured("gpt2-tiny").graph
    one = graph.subgraph([next(iter(graph))]).copy()
    html = render_html(one, colour_by="flops", size_by="time_s")
    assert ">1</span> node · 0 edges" in html
    assert f"colour: {METRICS['flops']} · size: {METRICS['time_s']}" in html
    assert "1 layer ·" in config_from_preset("gpt2-tiny", layers=1).describe()


def test_a_skip_edge_in_one_column_bows_round_the_nodes_between():
    """Focus on blocks.1 with modules collapsed lays the block out in one column (Add, mlp, ln_2, Add, attn, ln_1): the
    residual edge from the upper Add to the lower one ran straight behind mlp and ln_2 and could not be seen. It is
    curved now, far enough to clear the widest node between (vis-network's curve peaks about roundness x span / 2
    off the line); edges between neighbouring layers stay straight."""
    from graphviz_core.export.render import build_network, node_widths
    from graphviz_core.graph.layout import layered_layout
    from graphviz_core.ui.graph_view import apply_view

    view = apply_view(captured("gpt2-tiny"), focus="blocks.1", hide_shape=True, collapse=True, expanded=None)
    widths = node_widths(view)
    layout = layered_layout(view, widths=widths)
    curved = [e for e in build_network(view, layout=layout).edges if e.get("smooth")]
    assert len(curved) == 1 and {view.nodes[curved[0]["from"]]["op"], view.nodes[curved[0]["to"]]["op"]} == {"AddBackward0"}
    u, v = curved[0]["from"], curved[0]["to"]
    span = abs(layout.positions[u][1] - layout.positions[v][1])
    between = max(widths[n] for n in view if view.nodes[n]["module"] in ("blocks.1.mlp", "blocks.1.ln_2"))
    assert curved[0]["smooth"]["roundness"] * span / 2 >= between / 2  # the curve's peak clears the widest box


def test_a_folded_png_holds_the_whole_graph_at_a_readable_scale():
    """Past PNG_COLUMN_LAYERS a PNG folds its layers into columns. Folded to PNG_SIZE's shape, gpt2-tiny with 5 layers
    (230 nodes, 5 columns ~5,000 px wide) fitted only below MIN_FIT_SCALE, so the picture showed its top-left part;
    now the columns are as few as fit the graph's pane at PNG_COLUMN_SCALE, and the page as tall as they need."""
    import json
    import re

    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.config import config_from_preset
    from graphviz_core.export.formats import MIN_FIT_SCALE, PNG_SIZE
    from graphviz_core.export.render import (
        FIT_MARGIN,
        ONE_COLUMN,
        PNG_COLUMN_LAYERS,
        PNG_GRAPH_WIDTH,
        node_widths,
        png_page,
    )
    from graphviz_core.graph.layout import layered_layout

    graph = capture_backward(config_from_preset("gpt2-tiny", device="meta", layers=5)).graph
    html, height = png_page(graph)
    data = json.loads(re.search(r'id="graph-data" type="application/json">(.*?)</script>', html, re.S).group(1))
    widths = node_widths(graph)
    xs = [(n["x"] - widths[n["id"]] / 2, n["x"] + widths[n["id"]] / 2) for n in data["nodes"]]
    ys = [n["y"] for n in data["nodes"]]
    width, depth = max(r for _, r in xs) - min(left for left, _ in xs), max(ys) - min(ys) + 60
    one_column = layered_layout(graph, aspect=ONE_COLUMN, widths=widths)
    assert len(one_column.layers) > PNG_COLUMN_LAYERS  # too deep for one column: the folded picture
    # the scale at which the whole drawing fits the photographed pane (vis-network's fit: FIT_MARGIN of room)
    fit = min(PNG_GRAPH_WIDTH / (width * FIT_MARGIN), height / (depth * FIT_MARGIN))
    assert fit >= MIN_FIT_SCALE, (fit, width, depth, height)  # before: 0.24 at 1600 x 1000
    assert height > PNG_SIZE[1]


def test_graphs_side_by_side_share_one_colour_scale():
    """metric_range over two graphs and colour_range: a node whose value is the same in both is filled the same,
    and each graph's legend reads the ends of both graphs' values; alone, each graph spans its own white to dark red."""
    import networkx as nx

    from graphviz_core.export.render import build_network, colour_scale, format_metric, metric_range

    def graph(values):
        g = nx.DiGraph()
        for i, v in enumerate(values):
            g.add_node(f"n{i}", op="MulBackward0", category="elementwise", module="", grad_norm=v)
        return g

    a, b = graph([1.0, 2.0]), graph([2.0, 5.0])
    assert metric_range([a, b], "grad_norm") == (1.0, 5.0)
    assert metric_range([graph([])], "grad_norm") is None

    def fills(g, value_range=None):
        net = build_network(g, colour_by="grad_norm", colour_range=value_range)
        return {n["id"]: n["color"]["background"] for n in net.nodes}

    shared = metric_range([a, b], "grad_norm")
    # the value 2.0 in both graphs: one fill on the shared scale; alone, a's 2.0 is its darkest and b's its lightest
    assert fills(a, shared)["n1"] == fills(b, shared)["n0"]
    assert fills(a)["n1"] != fills(b)["n0"]
    ends = [format_metric("grad_norm", 1.0), format_metric("grad_norm", 5.0)]
    assert colour_scale(a, "grad_norm", shared)["ticks"][::2] == ends == colour_scale(b, "grad_norm", shared)["ticks"][::2]


def test_a_marked_set_is_drawn_dashed_beside_the_highlighted_one():
    """A recording's finding opened at its node rings the path from the loss in pink; the nodes whose gradient held
    a NaN keep a mark of their own (a dashed border, purple off the path, pink on it). With one mark for both, the
    NaN nodes off the path lost their ring and finite nodes on the path got the NaN's colour (a walkthrough)."""
    from graphviz_core.export.render import HIGHLIGHT_COLOUR, MARK_COLOUR

    g = nx.DiGraph()
    for name in ("loss", "a", "b", "c"):
        g.add_node(name, op=name, category="elementwise", module="")
    g.add_edges_from([("loss", "a"), ("a", "b"), ("loss", "c")])
    nodes = {n["id"]: n for n in build_network(g, highlight={"loss", "a"}, marked={"a", "c"}).nodes}
    assert nodes["loss"]["color"]["border"] == HIGHLIGHT_COLOUR and "shapeProperties" not in nodes["loss"]
    assert nodes["a"]["color"]["border"] == HIGHLIGHT_COLOUR and nodes["a"]["shapeProperties"]["borderDashes"]
    assert nodes["c"]["color"]["border"] == MARK_COLOUR and nodes["c"]["shapeProperties"]["borderDashes"]
    assert nodes["b"]["color"]["border"] == "#333333" and nodes["b"]["borderWidth"] == 1


def test_a_nan_metric_is_counted_as_no_finite_value():
    """A recorded step whose gradient held NaN: those nodes are drawn grey, off the colour scale, and the legend counts
    them as having no finite value (it said "no value", as if nothing had been measured)."""
    g = nx.DiGraph()
    for name, norm in (("loss", 1.0), ("a", float("nan")), ("b", 0.5)):
        g.add_node(name, op=name, category="elementwise", module="", saved_bytes=0, flops=0, time_s=None, grad_norm=norm)
    g.add_edges_from([("loss", "a"), ("a", "b")])
    html = render_html(g, colour_by="grad_norm")
    assert "no finite value: 1 node</div>" in html
