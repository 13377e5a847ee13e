"""The summary shown above the graph: counts, totals and a chart of nodes per category."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from graphviz_core.capture import Capture
from graphviz_core.ui.format import format_bytes, format_flops, format_seconds


def show_summary(capture: Capture) -> None:
    s, m, f, t = capture.summary, capture.memory, capture.flops, capture.time
    cols = st.columns(6)
    cols[0].metric("Nodes", f"{s.nodes:,}", help="autograd nodes reached from the loss")
    cols[1].metric("Edges", f"{s.edges:,}")
    cols[2].metric("Parameters", f"{s.parameters} tensors", f"{s.parameter_count:,} scalars", delta_color="off")
    cols[3].metric("Saved for backward", format_bytes(m.saved_bytes), help="storages de-duplicated, parameters excluded")
    cols[4].metric("Backward FLOPs", format_flops(f.backward), f"forward {format_flops(f.forward)}", delta_color="off")
    cols[5].metric("Backward time", format_seconds(t.backward_s), f"forward {format_seconds(t.forward_s)}", delta_color="off")
    if capture.loss is not None:
        st.caption(f"Loss {capture.loss:.4f} on {capture.device} · {capture.config.dtype} · config: "
                   + (f"preset {capture.config.preset}, " if capture.config.preset else "") + capture.config.describe())
    else:
        st.caption("meta device: shapes only — time, gradient norms and the loss value are not measured.")
    table = pd.DataFrame(
        {
            "nodes": pd.Series(s.by_category),
            "saved bytes": pd.Series(m.saved_bytes_by_category),
            "backward FLOPs": pd.Series(f.backward_by_category),
        }
    ).fillna(0).astype("int64")
    left, right = st.columns([3, 2])
    left.bar_chart(table["nodes"], horizontal=True, height=240, x_label="nodes per category", y_label="")
    right.dataframe(table, width="stretch", height=240)
