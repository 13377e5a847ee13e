"""Graph explorer: pick a config, run a real backward pass, read its autograd graph and its panels."""

import importlib

import streamlit as st

from graphviz_core.ui.capture_cache import get_capture, is_captured
from graphviz_core.ui.config_form import config_form
from graphviz_core.ui.links import VIEW, restore_choice
from graphviz_core.ui.navigation import run_through_app
from graphviz_core.ui.state import FLOPS_WIDGETS, MEMORY_WIDGETS, dim_stale_results, keep_widget_state
from graphviz_core.ui.summary import show_categories, show_summary

# Each tab's panel as module and function, imported when the tab is opened: the graph's page then never waits
# for the other panels' imports (pandas, Altair), which `make run` does in the background after the first graph
PANELS = {
    "Graph": ("graphviz_core.ui.graph_view", "graph_view"),
    "Measured vs textbook": ("graphviz_core.ui.textbook_view", "show_textbook_comparison"),
    "Memory": ("graphviz_core.ui.memory_view", "show_memory"),
    "FLOPs and time": ("graphviz_core.ui.flops_view", "show_flops"),
    "Debug": ("graphviz_core.ui.debug_view", "show_debug"),
}

run_through_app()
st.title("Inside the backward pass")
st.caption("A real forward and backward pass of the model on the left: every autograd node it ran, what each saved and cost.")
restore_choice("tab", list(PANELS))  # a link's unknown ?tab= falls back to the first tab, with a notice
config = config_form()
with dim_stale_results(config is not None and not is_captured(config)):  # the last config's figures, at once
    capture = get_capture(config, "config") if config is not None else None
    if capture is not None:
        show_summary(capture)
        if capture.compiled:  # --compile: each compiled node opened, under the figures (pandas: imported only here)
            importlib.import_module("graphviz_core.ui.compiled_view").show_compiled(capture)
        # One tab per panel, each reading the same capture (nothing here re-runs the backward pass). Only the open
        # tab is drawn: a newcomer's first page is the graph, sooner; the tab is in the URL (?tab=Memory).
        keep_widget_state([*(key for key, _ in VIEW.values()), *MEMORY_WIDGETS, *FLOPS_WIDGETS])
        tabs = st.tabs(list(PANELS), key="tab", bind="query-params")
        for tab, (module, panel) in zip(tabs, PANELS.values(), strict=True):
            if tab.open:
                with tab:
                    getattr(importlib.import_module(module), panel)(capture)
        # Under the open tab: the graph comes first on a laptop's screen.
        st.markdown("##### Per category: nodes, bytes saved for backward, backward FLOPs")
        show_categories(capture)
