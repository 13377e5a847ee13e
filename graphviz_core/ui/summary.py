"""The summary shown above the graph: counts and totals, and a chart and table of nodes per category."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from graphviz_core.capture import Capture
from graphviz_core.memory import meta_layer_norm_statistics
from graphviz_core.ui.format import bytes_unit, flops_unit, format_bytes, format_flops, format_seconds


def show_summary(capture: Capture) -> None:
    s, m, f, t = capture.summary, capture.memory, capture.flops, capture.time
    # Two rows of three: six metrics in one row cut values off ("28 te…", "677.8 …") at laptop widths.
    top, bottom = st.columns(3), st.columns(3)
    top[0].metric("Nodes", f"{s.nodes:,}", help="autograd nodes reached from the loss")
    top[1].metric("Edges", f"{s.edges:,}", help="gradient paths between nodes")
    top[2].metric("Parameters", f"{s.parameter_count:,}", f"in {s.parameters} tensors", delta_color="off", delta_arrow="off",
                  help="trainable scalars the backward pass computes a gradient for")
    bottom[0].metric("Saved for backward", format_bytes(m.saved_bytes), help="storages de-duplicated, parameters excluded")
    bottom[1].metric("Backward FLOPs", format_flops(f.backward), f"forward {format_flops(f.forward)}", delta_color="off", delta_arrow="off")
    bottom[2].metric("Backward time", format_seconds(t.backward_s), f"forward {format_seconds(t.forward_s)}", delta_color="off", delta_arrow="off",
                     help="wall time on this device, instrumentation included (the FLOPs and time tab measures it)")
    if capture.loss is not None:
        st.caption(f"Loss {capture.loss:.4f} on {capture.device} · {capture.config.dtype} · config: "
                   + (f"preset {capture.config.preset}, " if capture.config.preset else "") + capture.config.describe())
    else:
        st.caption("meta device: shapes only — time, gradient norms and the loss value are not measured.")
        norms, extra = meta_layer_norm_statistics(capture.graph, capture.device, capture.config.dtype)
        if norms:
            st.caption(
                f"Where this dry run and a CPU run differ: the meta kernel keeps each LayerNorm's mean and 1/std in "
                f"float32 (as CUDA does), the CPU kernel in {capture.config.dtype}; so a CPU run saves "
                f"{format_bytes(extra)} less ({norms} LayerNorms)."
            )


def show_categories(capture: Capture) -> None:
    """Nodes per category as a bar chart, and per category's saved bytes and backward FLOPs as a table."""
    s, m, f = capture.summary, capture.memory, capture.flops
    byte_unit, byte_div = bytes_unit(max(m.saved_bytes_by_category.values(), default=0))
    flop_unit, flop_div = flops_unit(max(f.backward_by_category.values(), default=0))
    table = pd.DataFrame(
        {
            "nodes": pd.Series(s.by_category),
            f"saved ({byte_unit})": pd.Series(m.saved_bytes_by_category) / byte_div,
            f"backward ({flop_unit})": pd.Series(f.backward_by_category) / flop_div,
        }
    ).fillna(0)
    table["nodes"] = table["nodes"].astype("int64")
    left, right = st.columns([3, 2])
    height = max(240, 24 * len(table))  # a bar per category with room for its label (12 for Llama: 288 px)
    left.bar_chart(table["nodes"], horizontal=True, height=height, x_label="nodes per category", y_label="")
    right.dataframe(table, width="stretch", height=height, column_config={
        f"saved ({byte_unit})": st.column_config.NumberColumn(format="%.1f", help="saved for backward, per category"),
        f"backward ({flop_unit})": st.column_config.NumberColumn(format="%.1f", help="backward FLOPs, per category"),
    })
