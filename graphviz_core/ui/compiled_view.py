"""The explorer's "Compiled backward" section: a torch.compile capture's regions, graph breaks, and each compiled node
opened (its backward FX graph drawn and listed, the tensors its forward saved, the forward ops it recomputes)."""

from __future__ import annotations

from collections import Counter

import pandas as pd
import streamlit as st

from graphviz_core.analysis.compare_training import compiled_peak_words
from graphviz_core.capture.result import Capture
from graphviz_core.export.render import node_widths, render_html
from graphviz_core.graph.compiled import LEGEND, fx_backward_graph, fx_layout, start_node
from graphviz_core.ui.format import escape_markdown, format_bytes, format_seconds
from graphviz_core.ui.graph_pages import graph_page
from graphviz_core.ui.vis_script import vis_src


def show_compiled(capture: Capture) -> None:
    """Nothing for an eager capture; for --compile, an expander that opens every CompiledFunctionBackward node."""
    summary = capture.compiled
    if not summary:
        return
    regions = summary["regions"]
    breaks = summary["graph_breaks"]
    title = (f"Compiled backward: {len(regions)} compiled node{'s' * (len(regions) != 1)}, {breaks} graph "
             f"break{'s' * (breaks != 1)}, compiled in {format_seconds(summary['compile_s'])}")
    with st.expander(title, key="compiled-backward"):
        st.caption(escape_markdown(f"Partitioned by {summary['partitioner']}; {summary['note']}."))
        eager, compiled = summary["eager_saved_bytes"], summary["saved_bytes"]
        if eager is not None:
            change = eager - compiled
            st.markdown(
                f"Saved for backward over the whole step: **{format_bytes(compiled)}** compiled, "
                f"**{format_bytes(eager)}** eager ({format_bytes(abs(change))} {'less' if change >= 0 else 'more'} "
                "compiled)."
            )
        why = compiled_peak_words(capture)
        if why:
            st.caption(escape_markdown(why[0].upper() + why[1:] + "."))
        for number, reason in enumerate(summary["break_reasons"], start=1):
            st.markdown(f"Graph break {number}: {escape_markdown(reason['reason'])} at `{reason['where']}`"
                        if reason["where"] else f"Graph break {number}: {escape_markdown(reason['reason'])}")
        if not regions:
            st.caption("No compiled region reached the backward (nothing in it needed a gradient).")
            return
        labels = {r["node"]: f"region {r['region'] + 1}: {r['node']}" for r in regions}
        chosen = st.selectbox("Compiled node", list(labels), format_func=labels.get, key="compiled.node",
                              disabled=len(regions) == 1,
                              help="One CompiledFunctionBackward node per compiled region (dynamo starts a new one "
                              "after each graph break)")
        _show_region(capture, chosen, capture.graph.nodes[chosen]["compiled"])


def _show_region(capture: Capture, node_id: str, opened: dict) -> None:
    recomputed = Counter(op["op"] for op in opened["recomputed"])
    st.markdown(
        f"**{node_id}**: its backward FX graph has **{opened['backward_nodes']:,} nodes** (the forward's: "
        f"{opened['forward_nodes']:,}); its forward saved **{format_bytes(opened['saved_bytes'])}** for it in "
        f"{len(opened['saved'])} tensors (parameters held anyway, not counted); it recomputes "
        f"**{len(opened['recomputed'])} forward ops** instead of saving them"
        + (f" ({escape_markdown(', '.join(f'{op} x{n}' for op, n in recomputed.most_common()))})." if recomputed
           else ".")
    )
    graph = fx_backward_graph(opened)
    src = vis_src()
    page = graph_page(capture, ("compiled", node_id, src), lambda nonce: render_html(
        graph, title=f"backward FX graph of {node_id}", subtitle="pink border: forward ops recomputed in backward",
        highlight={op["name"] for op in opened["recomputed"]}, highlight_is_search=False, vis_src=src, nonce=nonce,
        hint="Data flows top to bottom, from the incoming gradient to the returned gradients; each saved tensor (an "
             "oval) sits just above the first op that reads it.",
        top_label="Zoom to the incoming gradient", legend_labels=LEGEND, layout=fx_layout(graph, node_widths(graph)),
        start=start_node(graph)))
    st.iframe(page, height=620)
    saved, fx_nodes = st.tabs(["Saved tensors", "FX nodes"], key="compiled.tables")
    with saved:
        st.dataframe(pd.DataFrame([{"FX name": t["name"], "shape": str(tuple(t["shape"])), "dtype": t["dtype"],
                                    "storage bytes": t["storage_bytes"], "parameter": t["parameter"]}
                                   for t in opened["saved"]]), hide_index=True, width="stretch")
    with fx_nodes:
        st.dataframe(pd.DataFrame([{"FX name": n["name"], "op": n["target"],
                                    "role": "saved (a parameter: not counted)" if n["parameter"] else n["role"],
                                    "shape": "" if n["shape"] is None else str(tuple(n["shape"])),
                                    "bytes": n["bytes"], "inputs": ", ".join(n["inputs"])}
                                   for n in opened["nodes"]]), hide_index=True, width="stretch")
