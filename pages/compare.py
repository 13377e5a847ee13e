"""Compare two configs: both captured (cached), then their graphs, memory and FLOPs side by side with reasons."""

import streamlit as st

from graphviz_core.ui.capture_cache import get_capture, is_captured, start_capture
from graphviz_core.ui.compare_view import A, B, get_comparison, pick_configs, show_comparison
from graphviz_core.ui.navigation import run_through_app
from graphviz_core.ui.state import dim_stale_results

run_through_app()
st.title("Compare two configs")
st.caption(
    "Pick config A and config B (or a quick pair); both run a real forward and backward pass, then every "
    "difference is shown with B − A and a sentence saying why."
)
config_a, config_b = pick_configs()
with dim_stale_results(not (is_captured(config_a) and is_captured(config_b))):  # the last pair's figures, at once
    start_capture(config_b)  # a meta dry run of B runs in a second process while A is captured
    capture_a = get_capture(config_a, A)
    capture_b = get_capture(config_b, B) if capture_a is not None else None
    if capture_a is not None and capture_b is not None:
        show_comparison(get_comparison(capture_a, capture_b))
