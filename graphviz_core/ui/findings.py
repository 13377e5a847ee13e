"""Gradient-flow findings as the pages show them (docs/debugging.md): one table row each, one line each in the picker
that opens a finding at its node, and the graph drawn with that node selected and the path from the loss ringed.
Used by the Recordings page (a recorded loop) and the explorer's Debug tab (the config's step)."""

from __future__ import annotations

import networkx as nx
import pandas as pd
import streamlit as st

from graphviz_core.analysis.gradient_flow import finding_node, path_from_loss
from graphviz_core.export.render import METRICS, node_details, render_html
from graphviz_core.ui.format import escape_markdown, literal_cells
from graphviz_core.ui.vis_script import vis_src

# step first: the page's tables let their first two columns break anywhere (ui.routes.PAGE_CSS), which cut
# "no-gradient" to "no-grad ient"; numbers there lose nothing
FINDING_COLUMNS = ("step", "steps", "kind", "node", "module", "parameter", "source", "reason")
BREAK_AFTER = str.maketrans({".": ".\u200b", "_": "_\u200b", "/": "/\u200b"})  # where a long name may wrap
WRAPPED_AT_MOST = 40  # findings drawn as a table whose cells wrap; more: a data grid (scrolls, its cells cut)


def finding_label(f: dict) -> str:
    """A finding as one line of the picker: kind, step, where."""
    if f["kind"] == "no-gradient":  # by its parameter, and where its cut entered the graph (a detach, a no_grad)
        where = f.get("parameter") or f.get("module") or ""
        return f"{f['kind']} at step {f.get('step', '?')}: {where}" + (f" (cut at {f['node']})" if f.get("node") else "")
    where = f.get("node") or f.get("parameter") or f.get("module") or ""
    return f"{f['kind']} at step {f.get('step', '?')}: {where}" + (f" ({f['module']})" if f.get("node") and
                                                                     f.get("module") else "")


def _held(f: dict) -> str:
    """The steps a finding held (aggregated ones: figures.steps, first to last), "" for a one-step kind."""
    figures = f.get("figures") or {}
    count, last = figures.get("steps"), figures.get("last_step")
    if not count:
        return ""
    return f"{count:,} (to step {last})" if count > 1 and last is not None else f"{count:,}"


def _cell(f: dict, column: str) -> str:
    if column == "steps":
        return _held(f)
    value = f.get(column)
    if value is None:
        return ""
    if column == "source":  # the file's name and line: its whole path is in the line above a finding opened below
        return str(value).replace("\\", "/").rsplit("/", 1)[-1]
    return str(value)


def findings_frame(findings: list[dict]) -> pd.DataFrame:
    """The findings' table: text cells (the dataframe escapes them), empty where a field does not apply; "steps" is
    how many steps a finding held (a no-gradient or dead-units finding is listed once, at its first step)."""
    return pd.DataFrame([{c: _cell(f, c) for c in FINDING_COLUMNS} for f in findings])


def show_findings(findings: list[dict]) -> None:
    """The findings' table. Up to WRAPPED_AT_MOST rows as a table whose cells wrap, the reason read whole (a data
    grid cut the reason off the right edge at 1280 px and its module "(model) (F.relu 1)" to "(model) ("); more,
    as a data grid that scrolls, its node column wide enough for CompiledFunctionBackward."""
    frame = findings_frame(findings)
    if len(frame) <= WRAPPED_AT_MOST:
        # a module or parameter name is one word to the browser (model.layers.0.self_attn.q_proj.lora_A.default.weight):
        # it may break after its dots, so the table fits its column (it ran 380 px past it at 1280 px)
        names = ["node", "module", "parameter", "source"]
        frame[names] = frame[names].map(lambda text: text.translate(BREAK_AFTER))
        st.table(literal_cells(frame), hide_index=True)
        return
    st.dataframe(frame, width="stretch", hide_index=True,
                 column_config={"node": st.column_config.TextColumn(width="medium"),
                                "kind": st.column_config.TextColumn(width="medium"),
                                "reason": st.column_config.TextColumn(width="large")})


def _shape(shape) -> str:
    return "not recorded" if shape is None else "(" + ", ".join(f"{d:,}" for d in shape) + ")"


def _value(value) -> str:
    if value is None:
        return "not read"
    return value if isinstance(value, str) else f"{value:.4g}"


def gradients_frame(finding: dict) -> pd.DataFrame | None:
    """A non-finite node's finding as a table: each gradient it received and returned, each tensor saved for it, with
    shape, dtype, smallest and largest value and count of NaN or inf values. None for another kind of finding."""
    figures = finding.get("figures") or {}
    if "grad_out" not in figures:
        return None
    out = {**figures["grad_out"], "nonfinite": figures.get("nonfinite")}
    sent = out.get("gradients") or []
    one = len(sent) == 1

    def row(what: str, tensor: dict, values: dict | None, of: str) -> dict:  # values: the figures, None: not here
        shown = {k: "" for k in ("min", "max", "nonfinite")} if values is None else \
            {k: _value(values.get(k)) for k in ("min", "max", "nonfinite")}
        return {"what": what, "shape": _shape(tensor.get("shape")) if tensor else "",
                "dtype": tensor.get("dtype") or "" if tensor else "", "smallest": shown["min"],
                "largest": shown["max"], "NaN or inf values": shown["nonfinite"], "values are of": of}

    rows = [row(f"gradient received from {g.get('node', '')}", g, g,  # one set of figures per node: the sender's
                "this gradient" if (g.get("sender_returned") or 1) == 1 else
                f"all {g.get('sender_returned')} gradients {g.get('node', '')} returned")
            for g in figures.get("grad_in") or []]
    rows += [row(f"gradient returned to {g.get('parameter') or g.get('to', '')}", g, out if one else None,
                 "this gradient" if one else f"all {len(sent)} it returned, together: the row after them")
             for g in sent]
    if not one and sent:
        rows.append(row(f"all {len(sent)} gradients it returned", {}, out, "them together"))
    rows += [row(f"saved tensor {v.get('name') or ''}".strip(), v, v, "this tensor") for v in figures.get("saved") or []]
    return pd.DataFrame(rows)


def show_gradients(finding: dict) -> None:
    """The chosen finding in one sentence (kind, step, where, its whole reason), its gradients in and out and its
    saved tensors under a caption naming its node; for one inside a compiled region, how its op is named (the eager
    replay)."""
    where = ", ".join(part for part in (
        finding.get("parameter") and f"parameter {finding['parameter']}", finding.get("module") and
        f"module {finding['module']}", finding.get("source") and f"made at {finding['source']}") if part)
    reason = str(finding.get("reason") or "").rstrip(".")
    st.info(escape_markdown(f"{finding['kind']} at step {finding.get('step', '?')}" + (f" ({where})" if where else "")
                            + (f": {reason}." if reason else ".")))  # whole, where the table above cuts long reasons
    if finding.get("replay"):  # where the eager replay starts it (a preset's step), or how to replay (a recording)
        st.info(escape_markdown(f"Inside a compiled region: {finding['replay']}."))
    frame = gradients_frame(finding)
    if frame is None or frame.empty:
        return
    unread = (frame == "not read").any().any()
    st.caption(escape_markdown(f"What went in and out of {finding.get('node', 'the node')} at step "
                               f"{finding.get('step', '?')}: the gradients it received and returned, and the tensors "
                               f"saved for it." + (" Values not read: the recorder reads a saved tensor's values on "
                                                   "the CPU, of a plain dense tensor the node still holds after its "
                                                   "backward (a compiled region frees its own)."
                                                   if unread else "")))
    st.table(literal_cells(frame), hide_index=True)  # a few rows; wraps at 1280 px where a data grid clips


PLACED_AT_MOST = 100  # findings offered in the picker: each reads its step's graph on every rerun of the page


def placed(findings: list[dict], graph_of) -> list[tuple[dict, str]]:
    """(finding, node) for each of the first PLACED_AT_MOST findings that has a node in its step's graph;
    `graph_of(finding)` gives that graph (None where the finding's step has none). A run whose every step after a
    NaN is a finding would otherwise read a thousand graphs at each click."""
    out = []
    for f in findings[:PLACED_AT_MOST]:
        graph = graph_of(f)
        node = finding_node(graph, f) if graph is not None else None
        if node is not None:
            out.append((f, node))
    return out


def _figure(value: float | None) -> str:
    """A recorded figure to 4 significant digits; a zero reads 0, never -0 (recordings before the recorder's fix hold
    max |value| = -0.0 for an all-zero gradient)."""
    return "n/a" if value is None else f"{value + 0.0:.4g}"


def show_recorded_graph(graph: nx.DiGraph, focus: str | None, colour: str, *, title: str, subtitle: str,
                        at: str = "", colour_range: tuple[float, float] | None = None) -> None:
    """A recorded graph on the page: every node coloured by `colour`, its details with the recorded max |value| and
    count of NaN and inf values, and either `focus` (a finding's node) selected with the path from the loss ringed and
    every node whose gradient held a NaN or inf dashed, or those nodes ringed."""
    graph = graph.copy()  # the details go on a copy: the recording's graph is cached, and drawn again on each rerun
    broken = set()
    for node, data in graph.nodes(data=True):
        if data.get("nonfinite"):
            broken.add(node)
        data["details"] = node_details(node, data) + [
            ["max |value| of its gradient", _figure(data.get("max_abs"))],
            ["smallest and largest value of its gradient", "n/a" if data.get("min") is None else
             f"{_figure(data['min'])} to {_figure(data['max'])}"],
            ["NaN or inf values in its gradient", "n/a" if data.get("nonfinite") is None else f"{data['nonfinite']:,}"]]
    note = f"{graph.number_of_nodes():,} nodes; colour: {METRICS[colour]}{at}, white = least, dark red = most"
    if colour_range is not None:
        note += " of both steps (one scale for the two)"
    ringed, marked, selected = broken, set(), None
    if focus is not None and focus in graph:
        path = path_from_loss(graph, focus)
        ringed, marked, selected = set(path), broken, focus
        note += (f"; the finding's node {graph.nodes[focus].get('op', focus)} selected, and the {len(path):,} nodes "
                 f"from the loss down to it ringed in pink")
        if broken:  # the NaN's spread stays in sight beside the path, in a mark of its own
            note += f"; the {len(broken):,} nodes with a NaN or inf gradient dashed (purple, pink where on the path)"
    elif broken:
        note += f"; {len(broken):,} nodes with a NaN or inf gradient ringed in pink (grey: no finite value)"
    st.caption(escape_markdown(note))
    st.iframe(render_html(graph, title=title, subtitle=subtitle, colour_by=colour, highlight=frozenset(ringed),
                          marked=frozenset(marked), highlight_is_search=False, vis_src=vis_src(), selected=selected,
                          colour_range=colour_range),
              height=790)
