"""Turns a graph (DESIGN.md's schema, or a view of it) into one self-contained, offline HTML page.

pyvis builds the network (nodes, edges, options) and supplies its bundled vis-network script; the page
comes from our own Jinja2 template (`assets/graph_view.html.j2`) with autoescaping on. No URL outside the
page is referenced, a Content-Security-Policy forbids any network access, scripts run only with this
page's nonce, and every string from the graph reaches the DOM through `textContent` or the canvas.

Legend, as in torchviz's make_dot: fill colour = category (CATEGORY_COLOURS); boxes are operations,
ellipses are parameters (AccumulateGrad), dashed boxes are collapsed modules; arrows point the way the
gradient flows, from the loss down to the parameters.
"""

from __future__ import annotations

import json
import math
import secrets
from functools import lru_cache
from pathlib import Path

import jinja2
import networkx as nx
from markupsafe import Markup
from pyvis.network import Network

from graphviz_core.export import CATEGORY_COLOURS
from graphviz_core.layout import layered_layout
from graphviz_core.ui.format import format_bytes, format_flops, format_seconds

ASSETS = Path(__file__).resolve().parent.parent / "assets"
PYVIS_LIB = Path(__import__("pyvis").__file__).resolve().parent / "templates" / "lib" / "vis-9.1.2"
METRICS = {"time_s": "time", "flops": "FLOPs", "saved_bytes": "saved bytes", "grad_norm": "gradient norm"}
MODULE_COLOUR = "#f4f1ea"


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
    return (PYVIS_LIB / "vis-network.min.js").read_text(encoding="utf-8"), (PYVIS_LIB / "vis-network.css").read_text(encoding="utf-8")


def _short_op(op: str) -> str:
    return op.removesuffix("Backward0").removesuffix("Backward1")


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


def _metric_scale(graph: nx.DiGraph, metric: str | None) -> dict[str, float]:
    """0..1 per node: sqrt of value / max, so small nodes stay visible next to the biggest."""
    if not metric:
        return {}
    values = {n: _finite_or_none(d.get(metric)) or 0.0 for n, d in graph.nodes(data=True)}
    top = max(values.values(), default=0.0)
    return {n: math.sqrt(v / top) if top > 0 else 0.0 for n, v in values.items()}


def _heat(t: float) -> str:
    """White -> orange -> dark red."""
    stops = [(255, 255, 255), (253, 174, 97), (165, 0, 38)]
    seg = min(int(t * 2), 1)
    local = t * 2 - seg
    a, b = stops[seg], stops[seg + 1]
    red, green, blue = (round(a[i] + (b[i] - a[i]) * local) for i in range(3))
    return f"#{red:02x}{green:02x}{blue:02x}"


def build_network(
    graph: nx.DiGraph,
    *,
    colour_by: str | None = None,
    size_by: str | None = None,
    highlight: set[str] | frozenset = frozenset(),
) -> Network:
    """The pyvis Network for `graph`: server-side positions, physics off, one entry per node and edge."""
    layout = layered_layout(graph)
    net = Network(directed=True)
    net.node_ids = _IdList()
    colour_scale = _metric_scale(graph, colour_by)
    size_scale = _metric_scale(graph, size_by)
    for node, data in graph.nodes(data=True):
        x, y = layout.positions[node]
        category = data["category"]
        fill = MODULE_COLOUR if category == "module" else CATEGORY_COLOURS.get(category, "#000000")
        if colour_by:
            fill = _heat(colour_scale[node])
        options = dict(
            label=_label(data),
            x=x,
            y=y,
            shape="ellipse" if category == "accumulate_grad" else "box",
            color={"background": fill, "border": "#333333", "highlight": {"background": fill, "border": "#000000"}},
            borderWidth=1,
        )
        if category == "module":
            options["shapeProperties"] = {"borderDashes": [6, 4]}
            options["borderWidth"] = 2
        if size_by:
            options["shape"] = "dot"
            options["size"] = 6 + 40 * size_scale[node]
        if node in highlight:
            options["borderWidth"] = 5
            options["color"]["border"] = "#e6007e"
        net.add_node(node, **options)
    for u, v, edge in graph.edges(data=True):
        if edge.get("label"):
            net.add_edge(u, v, label=edge["label"], font={"size": 14, "color": "#b00020", "strokeWidth": 3})
        else:
            net.add_edge(u, v)
    net.set_options(json.dumps({  # pyvis parses this into a plain dict on net.options
        "physics": {"enabled": False},
        "layout": {"improvedLayout": False},
        "edges": {"smooth": False, "arrows": {"to": {"enabled": True, "scaleFactor": 0.5}}, "color": {"color": "#8a8a8a"}},
        "nodes": {"font": {"size": 13, "face": "monospace", "multi": False}, "margin": 6},
        "interaction": {"hover": True, "tooltipDelay": 120, "hideEdgesOnDrag": True, "navigationButtons": False,
                        "keyboard": False},
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
) -> str:
    """One self-contained HTML page drawing `graph` with vis-network; works offline, from disk or an iframe."""
    for metric in (colour_by, size_by):
        if metric is not None and metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}; choose one of: {', '.join(METRICS)}.")
    net = build_network(graph, colour_by=colour_by, size_by=size_by, highlight=highlight)
    nodes, edges = net.nodes, net.edges
    details = {node: node_details(node, data) for node, data in graph.nodes(data=True)}
    present = sorted({d["category"] for _, d in graph.nodes(data=True)})
    legend = [(c, MODULE_COLOUR if c == "module" else CATEGORY_COLOURS.get(c, "#000000")) for c in present]
    vis_js, vis_css = _vis_assets()
    return _environment().get_template("graph_view.html.j2").render(
        title=title,
        subtitle=subtitle,
        nonce=secrets.token_urlsafe(16),
        vis_js=Markup(vis_js.replace("</script", "<\\/script")),
        vis_css=Markup(vis_css.replace("</style", "<\\/style")),
        data={"nodes": nodes, "edges": edges, "options": net.options, "details": details},
        legend=legend,
        metric_note=(f"colour: {METRICS[colour_by]}" if colour_by else "") + (f"  size: {METRICS[size_by]}" if size_by else ""),
        height_px=height_px,
        node_count=len(nodes),
        edge_count=len(edges),
    )


def render_standalone_html(capture) -> str:
    """The capture's full graph as a standalone page (CLI `--format html`, the download button)."""
    config = capture.config
    name = config.preset or config.model
    subtitle = (f"{config.model} · {config.layers} layers · h={config.hidden} · b={config.batch} · s={config.seq} · "
                f"{config.attention} · checkpoint {config.checkpoint} · {capture.device}")
    return render_html(capture.graph, title=f"autograd graph: {name}", subtitle=subtitle)
