"""The "measured vs textbook" panels: formula, measurement, difference and its reason, side by side."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from graphviz_core.analysis.textbook import Comparison, backward_flops, memory_per_layer
from graphviz_core.capture.result import Capture
from graphviz_core.ui.format import format_bytes, format_flops, literal_cells


def _table(rows: list[Comparison], fmt) -> pd.DataFrame:
    return pd.DataFrame([
        {
            "term": r.term,
            "textbook": "—" if r.textbook is None else fmt(r.textbook),
            "measured": fmt(r.measured),
            "measured / textbook": "—" if not r.textbook else f"{r.measured / r.textbook:.3f}",
            "why they differ": r.note,
        }
        for r in rows
    ])


def show_textbook_comparison(capture: Capture) -> None:
    memory = memory_per_layer(capture)
    flops = backward_flops(capture)
    if not memory and not flops:
        st.caption("Textbook comparisons cover the transformer models: block, gpt2, and the Llama-style layers "
                   "(llama, mistral, qwen2). Every family's FLOPs against 6·N·tokens are under FLOPs and time.")
        return
    st.subheader("Measured vs textbook")
    if memory:
        st.markdown("**Activation memory of one layer** (saved for backward, mean over the layers), against the "
                    "published per-layer formula")
        st.table(literal_cells(_table(memory, format_bytes).set_index("term")))
    if flops:
        st.markdown("**Backward FLOPs**, term by term against the per-op derivation for GPT-2")
        st.table(literal_cells(_table(flops, format_flops).set_index("term")))
