"""The interactive graph on the explorer page: view controls in a fragment, so they never re-run backward."""

from __future__ import annotations

import shutil

import streamlit as st

from graphviz_core.capture.result import Capture
from graphviz_core.export.formats import PNG_SCALE, PNG_SIZE, png_problem, to_dot, to_graphml, to_json, to_png, to_svg
from graphviz_core.export.render import METRICS, png_page, render_html, render_standalone_html, run_description
from graphviz_core.graph.views import collapse_modules, focus_module, hide_categories, module_groups, search_nodes
from graphviz_core.ui.format import escape_markdown
from graphviz_core.ui.graph_pages import graph_page
from graphviz_core.ui.links import linked_node, sync_view_url
from graphviz_core.ui.vis_script import vis_src

WHOLE = "(whole model)"
NONE = "(none)"
BY_CATEGORY = "category"


def apply_view(capture: Capture, *, focus: str | None, hide_shape: bool, collapse: bool, expanded: str | None):
    """The graph the user asked to see, from the capture's graph (which is never changed)."""
    graph = capture.graph
    if focus:
        graph = focus_module(graph, focus)
    if hide_shape:
        graph = hide_categories(graph, {"shape"})
    if collapse:  # focused: the focused module's parts, each one node (collapsing the module itself left one node)
        graph = collapse_modules(graph, depth=2, expanded=expanded, within=focus or None)
    return graph


@st.fragment
def graph_view(capture: Capture) -> None:
    groups = module_groups(capture.graph, depth=2)
    row = st.columns([1, 1, 2.2])
    hide_shape = row[0].toggle("Hide shape ops", key="view.hide_shape",
                               help="View/transpose/expand… nodes removed; edges bridged through them")
    collapse = row[1].toggle("Collapse modules", key="view.collapse", help="Each block becomes one node with its totals")
    query = row[2].text_input("Search op, module or parameter", key="view.search", placeholder="e.g. Addmm, blocks.3.attn, wte",
                              label_visibility="collapsed")
    row = st.columns(4)
    expanded = row[0].selectbox("Expand one module", [NONE, *groups], key="view.expanded", disabled=not collapse,
                                help="With Collapse modules on: open one block and keep the others collapsed")
    focus = row[1].selectbox("Focus on", [WHOLE, *groups], key="view.focus")
    colour = row[2].selectbox("Colour by", [BY_CATEGORY, *METRICS], key="view.colour", format_func=lambda m: METRICS.get(m, m))
    size = row[3].selectbox("Size by", [NONE, *METRICS], key="view.size", format_func=lambda m: METRICS.get(m, m))

    view = apply_view(
        capture,
        focus=None if focus == WHOLE else focus,
        hide_shape=hide_shape,
        collapse=collapse,
        expanded=None if expanded == NONE else expanded,
    )
    matches = search_nodes(view, query)
    note = f"Showing {view.number_of_nodes():,} of {capture.summary.nodes:,} nodes"
    if query.strip():
        count = {0: "no node matches", 1: "1 match"}.get(len(matches), f"{len(matches):,} matches")
        note += f" · {count} “{escape_markdown(query.strip())}”" + (" (pink border)" if matches else "")
    st.caption(note)
    drawing = dict(
        title=f"autograd graph: {capture.config.preset or capture.config.model}",
        subtitle=run_description(capture.config, capture.device),
        colour_by=None if colour == BY_CATEGORY else colour,
        size_by=None if size == NONE else size,
        highlight=matches,
    )
    selected = linked_node(capture.config, view)
    sync_view_url()
    src = vis_src()
    # everything the page depends on besides the capture: the view's settings, the matches, the selection, the script
    key = (focus, hide_shape, collapse, expanded, colour, size, frozenset(matches), selected, src)
    st.iframe(graph_page(capture, key, lambda nonce: render_html(view, **drawing, vis_src=src, selected=selected,
                                                                  node_links=True, nonce=nonce)), height=790)
    settings = {"focus": None if focus == WHOLE else focus, "hide_shape": hide_shape, "collapse": collapse,
                "expanded": None if expanded == NONE else expanded, "colour_by": drawing["colour_by"],
                "size_by": drawing["size_by"], "search": query.strip()}
    _downloads(capture, view, drawing, settings)


def _view_fills(view, drawing: dict) -> dict[str, str]:
    """Each node's fill exactly as the screen draws it (category colours, or the colour-by scale)."""
    from graphviz_core.export.render import build_network

    net = build_network(view, colour_by=drawing["colour_by"], size_by=drawing["size_by"], highlight=drawing["highlight"])
    return {node["id"]: node["color"]["background"] for node in net.nodes}


def _view_dot_options(view, drawing: dict) -> dict:
    note = f"colour: {METRICS[drawing['colour_by']]}, white = least, dark red = most" if drawing["colour_by"] else ""
    legend = [] if drawing["colour_by"] else None  # None: the categories present
    return dict(fills=_view_fills(view, drawing), highlight=drawing["highlight"], title=drawing["title"],
                subtitle=drawing["subtitle"], legend=legend, legend_note=note)


def _png(graph, drawing: dict) -> bytes:
    # Rendered on the server by headless Chromium: the same page as the iframe, PNG_SCALE device pixels per CSS pixel,
    # fitted to the graph's area, legend in the side panel; layers top to bottom (export.render.png_page)
    page, height = png_page(graph, **drawing)
    return to_png(page, height=height)


def _downloads(capture: Capture, view, drawing: dict, settings: dict) -> None:
    """Two rows: this view (what the screen shows: hidden ops, collapsed modules, colours) and the whole graph.

    on_click="ignore": a click neither reruns the page nor the fragment, so the iframe is not re-rendered and
    keeps its zoom and selection; a rerun also dropped the other buttons' deferred files, so a second download
    clicked soon after failed ("Deferred file ... not found"). Files are built only when clicked.
    """
    name = (capture.config.preset or capture.config.model).replace(" ", "_")
    png, svg = png_problem(), None if shutil.which("dot") else "Needs Graphviz's dot (apt-get install graphviz)"
    width, height = PNG_SIZE
    png_help = png or (f"{width * PNG_SCALE} pixels wide ({PNG_SCALE}x density) and as tall as the graph's layers need, "
                       f"{height * PNG_SCALE} at least; rendered on the server by headless Chromium: layers top to "
                       "bottom, the legend beside them")
    svg_help = svg or "Laid out by Graphviz's dot, with a legend"
    _download_row("view", f"**This view** ({view.number_of_nodes():,} nodes, as drawn)", [
        ("PNG", lambda: _png(view, drawing), f"{name}-view.png", "image/png", png_help, png),
        ("SVG", lambda: to_svg(view, **_view_dot_options(view, drawing)), f"{name}-view.svg", "image/svg+xml",
         svg_help, svg),
        ("HTML", lambda: render_html(view, **drawing), f"{name}-view.html", "text/html",
         "This view as a standalone page: works offline from disk", None),
        ("JSON", lambda: to_json(capture, view, settings), f"{name}-view.json", "application/json",
         "The JSON contract with `graph` holding this view's nodes; `view` says what was applied", None),
        ("GraphML", lambda: to_graphml(view), f"{name}-view.graphml", "application/xml", None, None),
        ("DOT", lambda: to_dot(view, **_view_dot_options(view, drawing)), f"{name}-view.dot", "text/vnd.graphviz",
         "Graphviz source with the view's fills and a legend", None),
    ])
    _download_row("whole", f"**Whole graph** ({capture.graph.number_of_nodes():,} nodes)", [
        ("PNG", lambda: _png(capture.graph, {"title": drawing["title"], "subtitle": drawing["subtitle"]}), f"{name}.png",
         "image/png", png_help, png),
        ("SVG", lambda: to_svg(capture.graph, title=drawing["title"], subtitle=drawing["subtitle"]), f"{name}.svg", "image/svg+xml", svg_help, svg),
        ("HTML", lambda: render_standalone_html(capture), f"{name}.html", "text/html",
         "Works offline when opened from disk", None),
        ("JSON", lambda: to_json(capture), f"{name}.json", "application/json", "node-link graph plus summaries", None),
        ("GraphML", lambda: to_graphml(capture.graph), f"{name}.graphml", "application/xml", None, None),
        ("DOT", lambda: to_dot(capture.graph), f"{name}.dot", "text/vnd.graphviz", None, None),
    ])


def _download_row(key: str, heading: str, files: list) -> None:
    """One row of download buttons; the container's key (CSS class st-key-downloads-<key>) names the row."""
    with st.container(key=f"downloads-{key}"):
        cols = st.columns([1.6, 1, 1, 1, 1, 1, 1])
        cols[0].markdown(heading)
        for col, (label, data, file, mime, help_text, unavailable) in zip(cols[1:], files, strict=True):
            col.download_button(label, data, file, mime, key=f"download.{key}.{label.lower()}", help=help_text,
                                on_click="ignore", disabled=unavailable is not None)
