"""Turns a graph (graph/schema.py's records, or a view of it) into one self-contained, offline HTML page.

pyvis builds the network (nodes, edges, options) and supplies its bundled vis-network script; the page
comes from our own Jinja2 template (`assets/graph_view.html.j2`) with autoescaping on. No URL outside the
page is referenced (in the app, vis-network's script comes from the app's own server: `vis_src`), a
Content-Security-Policy forbids any other network access, scripts run only with this page's nonce, and every
string from the graph reaches the DOM through `textContent` or the canvas.

Legend, as in torchviz's make_dot: fill colour = category (CATEGORY_COLOURS); boxes are operations,
ellipses are parameters (AccumulateGrad), dashed boxes are collapsed modules; arrows point the way the
gradient flows, from the loss down to the parameters.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections import Counter
from functools import lru_cache
from pathlib import Path

import jinja2
import networkx as nx
from markupsafe import Markup
from pyvis.network import Network

from graphviz_core.config import applies
from graphviz_core.export.formats import CATEGORY_COLOURS, MIN_FIT_SCALE, PNG_SIZE
from graphviz_core.export.vis_asset import PYVIS_LIB, VIS_SCRIPT
from graphviz_core.graph.layout import ASPECT, LAYER_GAP, NODE_WIDTH, Layout, layered_layout
from graphviz_core.graph.views import module_group
from graphviz_core.units import format_bytes, format_flops, format_in, format_seconds

ASSETS = Path(__file__).resolve().parents[2] / "assets"
METRICS = {"time_s": "time", "flops": "FLOPs", "saved_bytes": "saved bytes", "grad_norm": "gradient norm"}
MODULE_COLOUR = "#f4f1ea"
FONT_PX = 13
# Level of detail. vis-network fades a label out over the pixel below its drawThreshold and skips it under
# drawThreshold - 1 (default 5: gone under 4 px). Labels are whole from MIN_FIT_SCALE (13 px x 0.45 = 5.85 px,
# the zoom the page opens at and a PNG is taken at) and gone under 4.85 px, scale 0.37; below that the page
# draws an overview: nodes as plain shapes batched by colour, edges as one path, no arrowheads, module names as
# landmarks; search matches and the selected node are still drawn in full and labelled at a readable size.
LABEL_DRAW_THRESHOLD = FONT_PX * MIN_FIT_SCALE
VIS_DRAW_THRESHOLD = 5
# Radii when sized by a metric. A dot's label hangs below it (two 13 px lines, from ~10 px under the dot's edge),
# and the next layer is LAYER_GAP (80 px) down: two big neighbours take 20 + 10 + 26 + 20 = 76 px, so no dot
# reaches a label. At 46 px (the old maximum) lm_head's Mm covered the label of the node above it.
DOT_MIN, DOT_MAX = 6, 20


class _IdList(list):
    """pyvis checks `id in node_ids` (a list) on every add: O(n) each. Same list, O(1) membership."""

    def __init__(self) -> None:
        super().__init__()
        self._ids: set = set()

    def append(self, item) -> None:
        super().append(item)
        self._ids.add(item)

    def __contains__(self, item) -> bool:
        return item in self._ids


def _json_script(value: object) -> Markup:
    """JSON safe inside <script>: <, > and & become \\u escapes, so no `</script>` can close the tag."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    return Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ASSETS), autoescape=True)
    env.filters["json_script"] = _json_script
    return env


@lru_cache(maxsize=1)
def _vis_assets() -> tuple[str, str]:
    """vis-network's script, and the one rule of its stylesheet this page can use: the 220 KB file styles the
    configurator, the editing toolbar and the navigation buttons (images inlined), none of which the page turns
    on; only the tooltip (a node with a `title`) remains."""
    css = (PYVIS_LIB / "vis-network.css").read_text(encoding="utf-8")
    rules = "".join(rule for rule in re.findall(r"[^{}]+\{[^{}]*\}", css) if "vis-tooltip" in rule.split("{")[0])
    return VIS_SCRIPT.read_text(encoding="utf-8"), rules


def _short_op(op: str) -> str:
    return op.removesuffix("Backward0").removesuffix("Backward1")


CHAR_PX = 0.6 * FONT_PX  # a monospace character's advance: 0.6 em


OVALS = frozenset({"accumulate_grad", "saved_tensor"})  # tensors (parameters, a compiled forward's saved ones), not ops


def node_widths(graph: nx.DiGraph) -> dict[str, float]:
    """px each node's shape takes at scale 1, from its label's longest line: a box adds its margins, an ellipse is
    ~1.15x its text (vis-network draws it around the text) plus room for its curve."""
    widths = {}
    for node, data in graph.nodes(data=True):
        text = max(len(line) for line in _label(data).split("\n")) * CHAR_PX
        widths[node] = text * 1.15 + 24 if data["category"] in OVALS else text + 14
    return widths


def _label(data: dict) -> str:
    if data.get("label"):
        return data["label"]
    if data.get("param"):
        return f"{data['param']['name']}\n{tuple(data['param']['shape'])}"
    if data["category"] == "module":
        return data["op"]
    module = data["module"].rsplit(".", 2)
    return f"{_short_op(data['op'])}\n{'.'.join(module[-2:])}" if data["module"] else _short_op(data["op"])


def _finite_or_none(value):
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def node_details(node: str, data: dict) -> list[list[str]]:
    """What the details panel shows for a node, as (field, text) rows."""
    if data.get("details"):
        return data["details"]
    rows = [["id", node], ["op", data["op"]], ["category", data["category"]], ["module", data["module"] or "(none)"]]
    if data.get("param"):
        rows.append(["parameter", f"{data['param']['name']} {tuple(data['param']['shape'])}"])
    if data["category"] == "module":
        rows.append(["nodes", str(data.get("members", 0))])
        rows.append(["by category", ", ".join(f"{k} {v}" for k, v in sorted(data.get("by_category", {}).items()))])
    rows.append(["saved bytes", format_bytes(data["saved_bytes"])])
    for tensor in data.get("saved", []):
        note = "" if tensor["counted"] else (" (parameter)" if tensor["parameter"] else " (shared, counted elsewhere)")
        rows.append(["  saved", f"{tuple(tensor['shape'])} {tensor['dtype']} {format_bytes(tensor['bytes'])}{note}"])
    if data.get("recomputed"):
        rows.append(["  saved", "nothing: this node's inputs are recomputed in backward (checkpoint)"])
    rows.extend(compiled_details(data.get("compiled")))
    rows.append(["FLOPs", format_flops(data["flops"])])
    if data.get("recompute_flops"):
        rows.append(["  of which recompute", format_flops(data["recompute_flops"])])
    rows.append(["time", format_seconds(data["time_s"])])
    norm = data.get("grad_norm")
    # A node sends one gradient per input; the norm shown is all of them combined (square root of the sum of
    # squares), so a residual add passing |g| to both branches shows sqrt(2)*|g|. Say so in the label.
    if data["category"] == "accumulate_grad":
        norm_label = "gradient norm (this parameter's gradient)"
    else:
        norm_label = "gradient norm (all gradients it sends to its inputs, combined)"
    rows.append([norm_label, "n/a" if norm is None else f"{norm:.4g}"])
    if data.get("backward_index") is not None:
        rows.append(["backward step", str(data["backward_index"])])
    return rows


def compiled_details(opened: dict | None) -> list[list[str]]:
    """A torch.compile region's rows in the details panel: its backward FX graph, what its forward saved for it and
    which forward ops it recomputes (the explorer's Compiled backward section shows the whole FX graph)."""
    if not opened:
        return []
    recomputed = Counter(op["op"] for op in opened["recomputed"])
    rows = [["compiled region", f"{opened['region'] + 1}: backward FX graph of {opened['backward_nodes']:,} nodes "
                                f"(forward {opened['forward_nodes']:,})"],
            ["  saved by its forward", f"{format_bytes(opened['saved_bytes'])} in {len(opened['saved'])} tensors "
                                       "(parameters not counted)"],
            ["  recomputed forward ops", ", ".join(f"{op} x{n}" for op, n in recomputed.most_common()) or "none"]]
    if opened["graph_break_after"]:
        rows.append(["  graph break after it", f"{opened['graph_break_after']} ({opened['graph_break_where']})"])
    return rows


HIGHLIGHT_COLOUR = "#e6007e"  # a highlighted node's border: search matches, a finding's path from the loss
MARK_COLOUR = "#7b2cbf"  # a marked node's dashed border (build_network's second set)
NO_VALUE_COLOUR = "#e0e0e0"  # a node without the metric (time and gradient norm on `meta`): grey, not "lowest"
DARK_TEXT, LIGHT_TEXT = "#000000", "#ffffff"  # black or white: one of them always reaches 4.58:1
HEAT_STOPS = ((255, 255, 255), (253, 174, 97), (165, 0, 38))  # white -> orange -> dark red


METRIC_UNITS = {"flops": "FLOP", "time_s": "s", "saved_bytes": "bytes"}  # other metrics (norms) are plain numbers


def format_metric(metric: str, value: float) -> str:
    """A metric's value in its unit: FLOP, seconds (µs/ms/s), bytes (KiB/MiB), a plain number for norms."""
    return format_in(METRIC_UNITS.get(metric, ""), value, plain="{:.4g}")


def _metric_values(graph: nx.DiGraph, metric: str) -> dict[str, float]:
    """The nodes that have a finite value of `metric`, and that value."""
    values = {n: _finite_or_none(d.get(metric)) for n, d in graph.nodes(data=True)}
    return {n: float(v) for n, v in values.items() if v is not None}


def metric_range(graphs: list[nx.DiGraph], metric: str) -> tuple[float, float] | None:
    """The lowest and highest finite value of `metric` over every graph: one colour scale for several graphs drawn
    side by side (two steps of a recording), so one colour is one value in all of them. None when none has a value."""
    values = [v for graph in graphs for v in _metric_values(graph, metric).values()]
    return (min(values), max(values)) if values else None


def _bounds(values: dict[str, float], value_range: tuple[float, float] | None) -> tuple[float, float]:
    if value_range is not None:
        return value_range
    return min(values.values(), default=0.0), max(values.values(), default=0.0)


def _metric_scale(graph: nx.DiGraph, metric: str | None,
                  value_range: tuple[float, float] | None = None) -> dict[str, float | None]:
    """0..1 per node: sqrt((value - min) / (max - min)), so small values stay visible next to the biggest; min and max
    are the graph's own, or `value_range` (a scale shared with other graphs). None for a node without a value."""
    if not metric:
        return {}
    values = _metric_values(graph, metric)
    low, high = _bounds(values, value_range)
    span = high - low

    def position(value: float) -> float:
        return math.sqrt(min(max((value - low) / span, 0.0), 1.0)) if span > 0 else 0.0

    return {n: position(values[n]) if n in values else None for n in graph}


def colour_scale(graph: nx.DiGraph, metric: str, value_range: tuple[float, float] | None = None) -> dict:
    """What the legend shows when colouring by `metric`: the bar's colours and its values at both ends and the
    middle (the colour runs with the square root, so the middle of the bar is min + (max - min) / 4)."""
    values = _metric_values(graph, metric)
    missing = graph.number_of_nodes() - len(values)
    scale = {"metric": METRICS[metric], "gradient": ", ".join(_heat(t) for t in (0.0, 0.25, 0.5, 0.75, 1.0)),
             "missing": missing, "missing_colour": NO_VALUE_COLOUR, "ticks": []}
    if values:
        low, high = _bounds(values, value_range)
        scale["ticks"] = [format_metric(metric, low + t * t * (high - low)) for t in (0.0, 0.5, 1.0)]
    return scale


def _heat(t: float) -> str:
    """White -> orange -> dark red."""
    seg = min(int(t * 2), 1)
    local = t * 2 - seg
    a, b = HEAT_STOPS[seg], HEAT_STOPS[seg + 1]
    red, green, blue = (round(a[i] + (b[i] - a[i]) * local) for i in range(3))
    return f"#{red:02x}{green:02x}{blue:02x}"


def relative_luminance(colour: str) -> float:
    """WCAG 2.1 relative luminance of a #rrggbb colour."""
    channels = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast_ratio(a: str, b: str) -> float:
    """WCAG contrast ratio of two colours (1 to 21; body text wants >= 4.5)."""
    la, lb = sorted((relative_luminance(a), relative_luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


@lru_cache(maxsize=256)  # called once per node, for a handful of fills
def text_colour(fill: str) -> str:
    """Dark or light label text, whichever contrasts more with `fill` (light on the darkest heat fills)."""
    return LIGHT_TEXT if contrast_ratio(LIGHT_TEXT, fill) > contrast_ratio(DARK_TEXT, fill) else DARK_TEXT


def _columns(layout: Layout) -> dict[str, int]:
    return {node: layout.column_of(depth) for depth, layer in enumerate(layout.layers) for node in layer}


def landmarks(graph: nx.DiGraph, layout: Layout) -> list[dict]:
    """One caption per module group (blocks.3, lm_head...) and column it appears in, above its first node
    there, at the column's left edge: what a zoomed-out view shows where node labels are too small to draw."""
    column = _columns(layout)
    xs: dict[int, float] = {}
    for node, (x, _) in layout.positions.items():
        xs[column[node]] = min(xs.get(column[node], x), x)
    tops: dict[tuple[str, int], float] = {}
    sizes: dict[tuple[str, int], int] = {}
    for node, data in graph.nodes(data=True):
        group = module_group(data["module"], 2)
        if not group or not graph.out_degree(node):  # leaves (parameters) can sit in the next block's rows
            continue
        key = (group, column[node])
        tops[key] = min(tops.get(key, math.inf), layout.positions[node][1])
        sizes[key] = sizes.get(key, 0) + 1
    return [{"text": group, "x": xs[col] - NODE_WIDTH / 2, "y": y - LAYER_GAP / 2, "nodes": sizes[group, col]}
            for (group, col), y in sorted(tops.items(), key=lambda item: (item[0][1], item[1]))]


def _first_column_span(layout: Layout, widths: dict[str, float]) -> dict | None:
    """Left and right edge of the first (the loss's) column of boxes, in canvas px: where the page's first view may
    start so that the column is whole."""
    column = _columns(layout)
    edges = [(layout.positions[n][0] - widths[n] / 2, layout.positions[n][0] + widths[n] / 2)
             for n in layout.positions if column[n] == 0]
    return {"left": min(e[0] for e in edges), "right": max(e[1] for e in edges)} if edges else None


def build_network(
    graph: nx.DiGraph,
    *,
    colour_by: str | None = None,
    size_by: str | None = None,
    highlight: set[str] | frozenset = frozenset(),
    layout: Layout | None = None,
    level_of_detail: bool = True,
    colour_range: tuple[float, float] | None = None,
    marked: set[str] | frozenset = frozenset(),
) -> Network:
    """The pyvis Network for `graph`: server-side positions, physics off, one entry per node and edge; `colour_range`
    fixes the colour scale's ends (metric_range over graphs drawn side by side). `highlight`'s nodes get a thick pink
    border; `marked`'s a dashed one (MARK_COLOUR; pink and dashed where a node is in both): a second set beside the
    first, e.g. a recording's nodes whose gradient held a NaN beside the path from the loss to a finding."""
    widths = node_widths(graph)
    layout = layout or layered_layout(graph, widths=widths)
    column = _columns(layout)
    net = Network(directed=True)
    net.node_ids = _IdList()
    colour_scale = _metric_scale(graph, colour_by, colour_range)
    size_scale = _metric_scale(graph, size_by)
    for node, data in graph.nodes(data=True):
        x, y = layout.positions[node]
        category = data["category"]
        fill = MODULE_COLOUR if category == "module" else CATEGORY_COLOURS.get(category, "#000000")
        if colour_by:
            t = colour_scale[node]
            fill = NO_VALUE_COLOUR if t is None else _heat(t)
        options = dict(
            label=_label(data),
            x=x,
            y=y,
            shape="ellipse" if category in OVALS else "box",
            color={"background": fill, "border": "#333333", "highlight": {"background": fill, "border": "#000000"}},
            borderWidth=1,
            # a dot's label sits below it, on the page's white; a box's or ellipse's sits on its fill
            font={"color": DARK_TEXT if size_by else text_colour(fill)},
        )
        if category == "module":
            options["shapeProperties"] = {"borderDashes": [6, 4]}
            options["borderWidth"] = 2
        if size_by:
            options["shape"] = "dot"
            options["size"] = DOT_MIN + (DOT_MAX - DOT_MIN) * (size_scale[node] or 0.0)
        if node in highlight:
            options["borderWidth"] = 5
            options["color"]["border"] = HIGHLIGHT_COLOUR
        if node in marked:
            options["borderWidth"] = 5
            options["shapeProperties"] = {"borderDashes": [6, 3]}
            if node not in highlight:
                options["color"]["border"] = MARK_COLOUR
        net.add_node(node, **options)
    depth = {node: d for d, layer in enumerate(layout.layers) for node in layer}
    for u, v, edge in graph.edges(data=True):
        if edge.get("label"):
            net.add_edge(u, v, label=edge["label"], font={"size": 14, "color": "#b00020", "strokeWidth": 3})
        elif column[u] != column[v]:  # runs from the foot of one folded column to the head of the next
            net.add_edge(u, v, dashes=True, color={"color": "#c8c8c8"})
        elif abs(depth[u] - depth[v]) > 1 and abs(layout.positions[u][0] - layout.positions[v][0]) < 1:
            # Straight down it would run behind the nodes between (a residual skip in a one-column view): bowed out to
            # the side. vis-network's curve peaks about roundness x span / 2 off the line; clear their widest half.
            x, span = layout.positions[u][0], abs(layout.positions[u][1] - layout.positions[v][1])
            between = [n for d in range(min(depth[u], depth[v]) + 1, max(depth[u], depth[v]))
                       for n in layout.layers[d] if abs(layout.positions[n][0] - x) < 1]
            clear = max((widths[n] / 2 for n in between), default=0) + 24
            net.add_edge(u, v, smooth={"enabled": True, "type": "curvedCW", "roundness": min(1.0, 2 * clear / span)})
        else:
            net.add_edge(u, v)
    net.set_options(json.dumps({  # pyvis parses this into a plain dict on net.options
        "physics": {"enabled": False},
        "layout": {"improvedLayout": False},
        "edges": {"smooth": False, "arrows": {"to": {"enabled": True, "scaleFactor": 0.5}}, "color": {"color": "#8a8a8a"}},
        "nodes": {"font": {"size": FONT_PX, "face": "monospace", "multi": False}, "margin": 6,
                  # vis-network skips a label when its size on screen < drawThreshold - 1 px
                  "scaling": {"label": {"drawThreshold": LABEL_DRAW_THRESHOLD if level_of_detail else VIS_DRAW_THRESHOLD}}},
        "interaction": {"hover": True, "tooltipDelay": 120, "hideEdgesOnDrag": True, "hideEdgesOnZoom": level_of_detail,
                        "navigationButtons": False, "keyboard": False},
    }))
    return net


def render_html(
    graph: nx.DiGraph,
    *,
    title: str = "autograd graph",
    subtitle: str = "",
    colour_by: str | None = None,
    size_by: str | None = None,
    highlight: set[str] | frozenset = frozenset(),
    height_px: int = 760,
    hint: str | None = None,
    legend_labels: dict[str, str] | None = None,
    highlight_is_search: bool = True,
    level_of_detail: bool = True,
    marked: set[str] | frozenset = frozenset(),
    vis_src: str | None = None,
    selected: str | None = None,
    node_links: bool = False,
    nonce: str | None = None,
    aspect: float = ASPECT,
    top_label: str = "Zoom to the loss",
    layout: Layout | None = None,
    start: str | None = None,
    colour_range: tuple[float, float] | None = None,
) -> str:
    """One self-contained HTML page drawing `graph` with vis-network; works offline, from disk or an iframe.

    `hint` replaces the line on how to read a model's graph, and `legend_labels` names categories in the
    legend (by default the category names): the toy-expression page's graph has variables, not parameters.
    `highlight_is_search=False`: the highlighted nodes are not search matches (no "Next match", no zoom to them).
    `marked`: a second set of nodes, drawn with a dashed border (build_network).
    `level_of_detail` draws less where it could not be read anyway (see LABEL_DRAW_THRESHOLD); off, every label, edge
    and arrowhead is drawn at every zoom (benchmarks/bench_fps.py compares the two).
    `vis_src`: a same-origin URL of vis-network's script (VIS_SCRIPT) to load instead of inlining its 470 KB, for
    pages a server shows again and again (the browser caches it once); the page is then not self-contained.
    `selected`: a node to open with selected, in view and its details shown (a link's `node=`; ignored when absent).
    `node_links`: the details panel offers a link to the node, made from the embedding page's URL (the app's pages).
    `nonce`: the page's script nonce (by default a fresh random one).
    `aspect`: the width : height the layout folds a deep graph to (graph.layout.layered_layout; ONE_COLUMN: never).
    `top_label`: the button that zooms to the first layer's first node (the loss in an autograd graph).
    `layout`: positions made by the caller (by default graph.layout.layered_layout's); `start`: the node the first
    view opens at and `top_label` zooms to, in place of the first layer's first node (an FX graph's incoming gradient).
    `colour_range`: the colour scale's lowest and highest value (metric_range), shared by graphs drawn side by side.
    """
    for metric in (colour_by, size_by):
        if metric is not None and metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}; choose one of: {', '.join(METRICS)}.")
    widths = node_widths(graph)
    layout = layout or layered_layout(graph, aspect=aspect, widths=widths)
    net = build_network(graph, colour_by=colour_by, size_by=size_by, highlight=highlight, layout=layout,
                        level_of_detail=level_of_detail, colour_range=colour_range, marked=marked)
    # search matches in backward order (nearest the loss first): the page opens on the first
    matches = [node for layer in layout.layers for node in layer if node in highlight] if highlight_is_search else []
    nodes, edges = net.nodes, net.edges
    details = {node: node_details(node, data) for node, data in graph.nodes(data=True)}
    present = sorted({d["category"] for _, d in graph.nodes(data=True)})
    legend = [(c, MODULE_COLOUR if c == "module" else CATEGORY_COLOURS.get(c, "#000000"), (legend_labels or {}).get(c, c))
              for c in present]
    vis_js, vis_css = _vis_assets()
    return _environment().get_template("graph_view.html.j2").render(
        title=title,
        top_label=top_label,
        subtitle=subtitle,
        nonce=nonce or secrets.token_urlsafe(16),
        vis_src=vis_src,
        vis_js=None if vis_src else Markup(vis_js.replace("</script", "<\\/script")),
        vis_css=Markup(vis_css.replace("</style", "<\\/style")),
        # the loss: the first node of the first layer (backward starts there), whatever order the graph's nodes are in
        data={"nodes": nodes, "edges": edges, "options": net.options, "details": details, "matches": matches,
              "loss": start if start in graph else layout.layers[0][0] if layout.layers else None,
              "loss_column": _first_column_span(layout, widths),
              "selected": selected if selected in details else None, "node_links": node_links,
              "landmarks": landmarks(graph, layout),
              "lod": {"enabled": level_of_detail, "readable_scale": MIN_FIT_SCALE,
                      "label_scale": ((LABEL_DRAW_THRESHOLD if level_of_detail else VIS_DRAW_THRESHOLD) - 1) / FONT_PX}},
        legend=legend,
        hint=hint,
        scale=colour_scale(graph, colour_by, colour_range) if colour_by else None,
        metric_note=" · ".join(([f"colour: {METRICS[colour_by]}"] if colour_by else [])
                               + ([f"size: {METRICS[size_by]}"] if size_by else [])),
        height_px=height_px,
        node_count=f"{len(nodes):,}",  # 6,500 nodes, not 6500
        nodes_word="node" if len(nodes) == 1 else "nodes",
        edge_count=f"{len(edges):,} edge{'' if len(edges) == 1 else 's'}",
    )


ATTENTION_WORDS = {"sdpa": "fused", "mha": "nn.MultiheadAttention", "manual": "spelled-out", "eager": "spelled-out"}


def run_description(config, device: str | None = None) -> str:
    """Everything that produced a result, in one line: the page's line under the figures, the compare page's headers
    and every exported picture use it. The family's own words (a vision model shows its image size, no sequence or
    attention), batch, dtype and the device (`device`: the one a capture ran on, in place of a requested `auto`), then
    the attention kernel where the family has one and the checkpointing, named even when off (a user's own module
    decides both itself: neither is claimed for it)."""
    parts = [config.describe(device=device)]
    compiled = ["torch.compile (inductor's partitioner, no code generated)"] if config.compile else []
    compiled += _training_words(config)
    if config.family.user_code:
        return " · ".join([*parts, *compiled])
    if applies("attention", config.model):
        parts.append(f"{config.attention} attention ({ATTENTION_WORDS.get(config.attention, config.attention)})")
    parts.append("no checkpointing" if config.checkpoint == "none" else f"checkpoint {config.checkpoint}")
    return " · ".join([*parts, *compiled])


def _training_words(config) -> list[str]:
    """Autocast and the optimizer, where not the defaults (none; AdamW)."""
    from graphviz_core.capture.instruments.optimizer import OPTIMIZER_NAMES

    words = [f"{config.autocast} autocast" + (" + GradScaler" if config.autocast == "float16" else "")
             ] if config.autocast != "none" else []
    if config.optimizer != "adamw":
        words.append(f"{OPTIMIZER_NAMES[config.optimizer]} optimizer")
    return words


def render_standalone_html(capture) -> str:
    """The capture's full graph as a standalone page (CLI `--format html`, the download button)."""
    return render_html(capture.graph, **_standalone_titles(capture))


def standalone_png_page(capture) -> tuple[str, int]:
    """The page a PNG of the capture's full graph photographs, and its height in CSS px (CLI `--format png`): laid out
    as the app's PNG downloads are (png_page), layers top to bottom."""
    return png_page(capture.graph, **_standalone_titles(capture))


def _standalone_titles(capture) -> dict[str, str]:
    config = capture.config
    name = config.preset or config.model
    return dict(title=f"autograd graph: {name}", subtitle=run_description(config, capture.device))


ONE_COLUMN = 1e-6  # an aspect no fold comes near: layered_layout keeps every layer in one column
# A picture of up to this many layers is one column, top to bottom (48 layers: ~2,140 px, about twice the default): the
# graph as the explorer's first view reads it. gpt2-tiny with shape ops hidden (27 layers) was folded into two columns
# side by side, blocks.1 beside blocks.0. Deeper graphs are folded as on screen.
PNG_COLUMN_LAYERS = 48
PNG_COLUMN_SCALE = 0.5  # the scale the column's picture is made tall enough for: labels whole (MIN_FIT_SCALE 0.45)
FIT_MARGIN = 1.12  # vis-network's fit leaves about this much room around the drawing


PNG_GRAPH_WIDTH = PNG_SIZE[0] - 330  # CSS px of a PNG's graph pane: the page's width less the side panel (300 + margins)
PNG_MAX_HEIGHT = 8000  # CSS px: formats.png_problem's limit


def png_page(graph: nx.DiGraph, **drawing) -> tuple[str, int]:
    """The page a PNG of `graph` photographs (render_html with `drawing`), and its height in CSS px: one column of
    layers top to bottom as tall as it must be to read at PNG_COLUMN_SCALE (at least PNG_SIZE's height), or, past
    PNG_COLUMN_LAYERS, folded into as few columns as fit the pane's width at that scale, as tall as they must be.

    Folded at PNG_SIZE's own shape instead, gpt2-tiny with 5 layers (230 nodes) made five columns that fitted only at
    a scale below MIN_FIT_SCALE: the picture showed their top-left part, at the minimum scale."""
    widths = node_widths(graph)
    layers = len(layered_layout(graph, aspect=ONE_COLUMN, widths=widths).layers)
    if layers <= PNG_COLUMN_LAYERS:
        # the column's height: a layer every LAYER_GAP, plus the first and last rows' boxes and their labels (~60 px)
        height = max(PNG_SIZE[1], math.ceil(((layers - 1) * LAYER_GAP + 60) * FIT_MARGIN * PNG_COLUMN_SCALE))
        return render_html(graph, **drawing, height_px=height, aspect=ONE_COLUMN), height
    aspect = PNG_SIZE[0] / PNG_SIZE[1]
    for _ in range(16):  # fewer, taller columns until they fit the pane's width at PNG_COLUMN_SCALE
        width, depth = _extent(layered_layout(graph, aspect=aspect, widths=widths), widths)
        if width * FIT_MARGIN * PNG_COLUMN_SCALE <= PNG_GRAPH_WIDTH:
            break
        aspect /= 1.4
    height = min(PNG_MAX_HEIGHT, max(PNG_SIZE[1], math.ceil((depth + 60) * FIT_MARGIN * PNG_COLUMN_SCALE)))
    return render_html(graph, **drawing, height_px=height, aspect=aspect), height


def _extent(layout: Layout, widths: dict[str, float]) -> tuple[float, float]:
    """Width and height in canvas px of a layout's drawing (boxes included, labels' rows not)."""
    xs = [(x - widths[n] / 2, x + widths[n] / 2) for n, (x, _) in layout.positions.items()]
    ys = [y for _, y in layout.positions.values()]
    return max(r for _, r in xs) - min(left for left, _ in xs), max(ys) - min(ys)
