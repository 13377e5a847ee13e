"""Writes a Capture, or a view of its graph: JSON (the contract; its graph in graph/schema.py's records),
GraphML, DOT, SVG, and PNG (a rendered page photographed by headless Chromium).

HTML lives in `graphviz_core.export.render`, which is allowed to use pyvis.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping

import networkx as nx

from graphviz_core.analysis.training_step import memory_details
from graphviz_core.capture.result import Capture
from graphviz_core.graph.schema import SCHEMA_VERSION

FORMATS = ("json", "html", "graphml", "dot", "svg")
MODULE_COLOUR = "#f4f1ea"  # a collapsed module (graph.collapse_modules), as in the interactive view
HIGHLIGHT_COLOUR = "#e6007e"  # a search match's border, as in the interactive view

# Fill colours per category, shared by DOT/SVG and the interactive view (colour-blind-safe where possible).
CATEGORY_COLOURS = {
    "attention": "#d62728",
    "matmul": "#1f77b4",
    "normalization": "#9467bd",
    "activation": "#ff7f0e",
    "elementwise": "#bcbd22",
    "residual_add": "#2ca02c",
    "reduction": "#8c564b",
    "loss": "#e377c2",
    "embedding": "#17becf",
    "shape": "#c7c7c7",
    "conversion": "#7f7f7f",
    "cast": "#a55194",  # autocast's casts: a magenta apart from conversion's grey
    "checkpoint": "#393b79",
    "compiled": "#637939",
    "accumulate_grad": "#ffdd57",
    "conv": "#6baed6",
    "position": "#f7b6d2",
    "routing": "#dbdb8d",
    "pooling": "#9edae5",
    "communication": "#ad494a",
    "other": "#000000",
    # a compiled region's backward FX graph (graph/compiled.py): its inputs and its output by role
    "saved_tensor": "#ffbb78",  # an oval, as the autograd graph's parameters: a tensor, not an op
    "incoming_gradient": "#c5b0d5",
    "returned_gradients": "#98df8a",
}


def _finite(value: object) -> object:
    """JSON has no NaN/inf: non-finite floats (an exploding gradient norm) become their string names."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def capture_to_dict(capture: Capture, graph: nx.DiGraph | None = None, view: Mapping | None = None) -> dict:
    """The `graph --format json` object (docs/cli.md): schema version (graph/schema.py), config, device, summaries
    and the graph.

    `graph` replaces the capture's graph with a view of it (shape ops hidden, modules collapsed...); the
    summaries still describe the whole capture, and `view` (what was applied) is written beside them with the
    view's own node and edge counts, so a reader can tell the two apart.
    """
    graph = capture.graph if graph is None else graph
    extra = {}
    if view is not None:
        extra["view"] = {**view, "nodes": graph.number_of_nodes(), "edges": graph.number_of_edges()}
    return _finite(
        {
            "schema": SCHEMA_VERSION,
            "config": capture.config.shown(),
            "device": capture.device,
            "loss": capture.loss,
            "summary": dataclasses.asdict(capture.summary),
            # the headline first: what the forward leaves alive for backward (saved + held for recompute)
            "memory": {"kept_for_backward_bytes": capture.memory.kept_for_backward_bytes,
                       **dataclasses.asdict(capture.memory), **memory_details(capture)},
            "flops": dataclasses.asdict(capture.flops),
            "time": dataclasses.asdict(capture.time),
            # the training step as it ran: torch.optim's state after one step, what autocast did, how (notes)
            "optimizer": dataclasses.asdict(capture.optimizer) if capture.optimizer else None,
            "autocast": dataclasses.asdict(capture.autocast) if capture.autocast else None,
            "notes": list(capture.notes),
            "backward_order": list(capture.backward_order),
            "save_order": [dataclasses.asdict(e) for e in capture.save_order],
            **({"compile": capture.compiled} if capture.compiled is not None else {}),
            **extra,
            "graph": nx.node_link_data(graph, edges="links"),
        }
    )


def to_json(capture: Capture, graph: nx.DiGraph | None = None, view: Mapping | None = None) -> str:
    return json.dumps(capture_to_dict(capture, graph, view), indent=1)


def to_graphml(graph: nx.DiGraph) -> str:
    """GraphML keeps scalars only: lists and dicts are stored as JSON text, None as an empty string."""
    flat = nx.DiGraph()
    for node, data in graph.nodes(data=True):
        flat.add_node(node, **{k: _graphml_value(v) for k, v in data.items()})
    flat.add_edges_from(graph.edges())
    return "\n".join(nx.generate_graphml(flat))


def _graphml_value(value: object) -> object:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return value


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _ink(fill: str) -> str:
    """Black or white text, whichever reads better on `fill` (#rrggbb): WCAG relative luminance."""
    def channel(c: int) -> float:
        c = c / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    red, green, blue = (channel(int(fill[i : i + 2], 16)) for i in (1, 3, 5))
    luminance = 0.2126 * red + 0.7152 * green + 0.0722 * blue
    return "#000000" if luminance > 0.179 else "#ffffff"


def category_legend(graph: nx.DiGraph) -> list[tuple[str, str]]:
    """(category, fill) for each category present, as the interactive view's legend lists them."""
    present = sorted({d["category"] for _, d in graph.nodes(data=True)})
    return [(c, MODULE_COLOUR if c == "module" else CATEGORY_COLOURS.get(c, "#000000")) for c in present]


def _dot_label(data: dict) -> str:
    if data.get("param"):
        return f"{data['param']['name']}\n{tuple(data['param']['shape'])}"
    if data["category"] == "module" or not data.get("module"):
        return data["op"]  # a collapsed module's op already names it: "blocks.0 (43 nodes)"
    return f"{data['op']}\n{data['module']}"


def _legend_label(title: str, legend: list[tuple[str, str]], note: str, subtitle: str = "") -> str:
    """A Graphviz HTML-like label: the title, subtitle and note, then one ■ swatch per legend row (every text
    escaped). One column: Graphviz shares a wide title's width among the columns it spans, so a swatch cell
    beside the name stretched to a bar as wide as half the subtitle."""
    rows = [f"<B>{html.escape(title)}</B>"] if title else []
    rows += [html.escape(text) for text in (subtitle, note) if text]
    rows += [f'<FONT COLOR="{html.escape(colour)}" POINT-SIZE="16">■</FONT> {html.escape(name)}' for name, colour in legend]
    cells = "".join(f'<TR><TD ALIGN="LEFT">{row}</TD></TR>' for row in rows)
    return f'<<TABLE BORDER="0" CELLSPACING="2" CELLPADDING="1">{cells}</TABLE>>'


def to_dot(
    graph: nx.DiGraph,
    *,
    fills: Mapping[str, str] | None = None,
    highlight: set[str] | frozenset = frozenset(),
    title: str = "",
    subtitle: str = "",
    legend: list[tuple[str, str]] | None = None,
    legend_note: str = "",
) -> str:
    """Graphviz DOT: one box per node (op and module), filled by category; edges follow gradient flow.

    A view passes what the screen shows: `fills` (node -> #rrggbb, e.g. coloured by FLOPs) replaces the
    category colours, `highlight` draws search matches with a thick pink border, and `title`, `subtitle`, `legend`
    and `legend_note` become a legend at the top (by default the categories present). Collapsed modules are
    dashed boxes, parameters ellipses, as in the interactive view.
    """
    lines = [
        "digraph autograd {",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
    ]
    if title or legend or legend is None:
        lines.append(f'  graph [labelloc=t, labeljust=l, fontname="Helvetica", fontsize=11, '
                     f"label={_legend_label(title, category_legend(graph) if legend is None else legend, legend_note, subtitle)}];")
    for node, data in graph.nodes(data=True):
        category = data["category"]
        colour = MODULE_COLOUR if category == "module" else CATEGORY_COLOURS.get(category, "#000000")
        if fills is not None and node in fills:
            colour = fills[node]
        attrs = [f"label={_dot_quote(_dot_label(data))}", f"fillcolor={_dot_quote(colour)}",
                 f"fontcolor={_dot_quote(_ink(colour))}"]
        if category == "accumulate_grad":
            attrs.append("shape=ellipse")
        if category == "module":
            attrs.append('style="rounded,filled,dashed"')
        if node in highlight:
            attrs += [f"color={_dot_quote(HIGHLIGHT_COLOUR)}", "penwidth=4"]
        lines.append(f"  {_dot_quote(node)} [{', '.join(attrs)}];")
    for u, v in graph.edges():
        lines.append(f"  {_dot_quote(u)} -> {_dot_quote(v)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_svg(graph: nx.DiGraph, **dot_options) -> str:
    """SVG through Graphviz's `dot` (same options as `to_dot`); a ValueError that says how to get `dot`."""
    dot = shutil.which("dot")
    if dot is None:
        raise ValueError(
            "SVG needs Graphviz's `dot` program, which is not installed; install it (apt-get install graphviz) "
            "or use --format dot / html."
        )
    done = subprocess.run([dot, "-Tsvg"], input=to_dot(graph, **dot_options), capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise ValueError(f"Graphviz `dot` failed: {done.stderr.strip().splitlines()[0] if done.stderr else done.returncode}")
    return done.stdout


# Debian's Chromium, driven by Playwright (`playwright install` cannot download browsers here), with the flags
# a container needs: no sandbox (no user namespaces), no GPU, /tmp instead of a small /dev/shm, and nothing
# fetched in the background (updates, component downloads, first-run pages).
CHROMIUM = os.environ.get("GRAPHVIZ_CORE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
PNG_SIZE = (1600, 1000)  # CSS pixels: the graph beside its 300 px side panel (title, legend)
PNG_SCALE = 2  # device pixels per CSS pixel: crisp on a high-density screen and when zoomed in docs
# Below this zoom a fitted graph's 13 px labels shrink under ~6 px (12 device pixels at 2x): unreadable. The
# picture then shows the graph's top-left corner (the loss is at the top) at this zoom; the interactive page
# uses the same threshold before it starts at the loss instead of fitting.
MIN_FIT_SCALE = 0.45
# A shared server launches one Chromium (~200 MB) per PNG click: at most two at once, the rest wait their turn.
PNG_RENDERS = threading.BoundedSemaphore(2)


def png_problem(width: int = PNG_SIZE[0], height: int = PNG_SIZE[1], scale: int = PNG_SCALE) -> str | None:
    """None when a PNG of this size can be rendered here, else the sentence that says why not."""
    import importlib.util

    if not (100 <= width <= 8000 and 100 <= height <= 8000 and 1 <= scale <= 4):
        return f"a PNG of {width}x{height} at {scale}x is out of range: 100..8000 pixels a side, scale 1..4."
    if not os.path.exists(CHROMIUM):
        return (f"PNG needs Chromium at {CHROMIUM}, which is missing; install it (apt-get install chromium) "
                "or use --format svg / html.")
    if importlib.util.find_spec("playwright") is None:
        return "PNG needs Playwright to drive Chromium; pip install playwright."
    return None


def to_png(page_html: str, *, width: int = PNG_SIZE[0], height: int = PNG_SIZE[1], scale: int = PNG_SCALE) -> bytes:
    """A rendered graph page (`render.render_html`) photographed by headless Chromium: width*scale x height*scale.

    The page fills the viewport, the graph is fitted to its area (unless that makes labels unreadable), and
    the side panel with the title and legend is in the picture. Nothing is fetched: the page is self-contained
    and its Content-Security-Policy forbids network access.
    """
    if problem := png_problem(width, height, scale):
        raise ValueError(problem)
    # Playwright's sync API refuses to start inside a running asyncio loop (a Streamlit server thread, a test
    # session already driving a browser): photograph from a thread of its own.
    from concurrent.futures import ThreadPoolExecutor

    with PNG_RENDERS, ThreadPoolExecutor(1, thread_name_prefix="png") as pool:
        return pool.submit(_photograph, page_html, width, height, scale).result()


def wait_until_drawn(page, timeout_ms: int) -> None:
    """Wait until a graph page (render.render_html's) has drawn once: its `window.__firstDrawMs` is set. Asked from
    here every 100 ms: Playwright's wait_for_function asks again with eval inside the page, which the page's
    Content-Security-Policy (no 'unsafe-eval') refuses whenever its first look came before the draw (seen as an
    EvalError in a browser test)."""
    deadline = time.monotonic() + timeout_ms / 1000
    while page.evaluate("window.__firstDrawMs === undefined"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the graph was not drawn within {timeout_ms / 1000:g} s")
        page.wait_for_timeout(100)


def _photograph(page_html: str, width: int, height: int, scale: int) -> bytes:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height}, device_scale_factor=scale)
            page.set_content(page_html, wait_until="load")
            wait_until_drawn(page, 120_000)
            page.evaluate(
                """minScale => {
                  const wrap = document.getElementById("wrap");
                  if (wrap) { wrap.style.height = window.innerHeight + "px"; }
                  const net = window.network;
                  net.setSize("100%", "100%");
                  net.redraw();
                  net.fit({animation: false});
                  if (net.getScale() < minScale) {
                    let left = Infinity, top = Infinity;
                    for (const id of net.body.data.nodes.getIds()) {
                      const box = net.getBoundingBox(id);  // the drawn shape, label included
                      left = Math.min(left, box.left); top = Math.min(top, box.top);
                    }
                    const canvas = net.canvas.frame.canvas, margin = 20;
                    net.moveTo({position: {x: left - margin + canvas.clientWidth / 2 / minScale,
                                           y: top - margin + canvas.clientHeight / 2 / minScale},
                                scale: minScale, animation: false});
                  }
                  net.redraw();
                }""",
                MIN_FIT_SCALE,
            )
            # Buttons and "No node selected." mean nothing in a picture; the title, counts, hint and legend stay.
            page.evaluate("""() => {
                  for (const id of ["fit", "top"]) { const b = document.getElementById(id); if (b) { b.style.display = "none"; } }
                  const details = document.getElementById("details");
                  if (details && !details.querySelector("table")) { details.style.display = "none"; }
                }""")
            page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
            return page.screenshot(type="png")
        finally:
            browser.close()
