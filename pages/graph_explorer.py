"""Graph explorer: pick a config, run a real backward pass, read its autograd graph and its panels."""

import streamlit as st

from graphviz_core.ui.capture_cache import get_capture
from graphviz_core.ui.config_form import config_form
from graphviz_core.ui.flops_view import show_flops
from graphviz_core.ui.graph_view import graph_view
from graphviz_core.ui.memory_view import show_memory
from graphviz_core.ui.navigation import run_through_app
from graphviz_core.ui.summary import show_summary
from graphviz_core.ui.textbook_view import show_textbook_comparison

run_through_app()
st.title("Inside the backward pass")
st.caption("A real forward and backward pass of the model on the left: every autograd node it ran, what each saved and cost.")
config = config_form()
capture = get_capture(config) if config is not None else None
if capture is not None:
    show_summary(capture)
    # One tab per panel; each panel reads the same capture (nothing here re-runs the backward pass).
    graph_tab, textbook_tab, memory_tab, flops_tab = st.tabs(["Graph", "Measured vs textbook", "Memory", "FLOPs and time"])
    with graph_tab:
        graph_view(capture)
    with textbook_tab:
        show_textbook_comparison(capture)
    with memory_tab:
        show_memory(capture)
    with flops_tab:
        show_flops(capture)
