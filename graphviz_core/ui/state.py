"""Session state that outlives the widgets drawing it."""

from __future__ import annotations

from collections.abc import Iterable

import streamlit as st

# The panels' choices the explorer keeps while another tab is open (keep_widget_state). Here, not in the panels'
# modules, so that the explorer's first run need not import those (pandas, Altair: ~0.7 s on a cold server).
MEMORY_WIDGETS = ("memory.optimizer", "memory.ckpt_device", "memory.budget_choice", "memory.budget_gib")
FLOPS_WIDGETS = ("flops.both_ways", "flops.top_n")


def keep_widget_state(keys: Iterable[str]) -> None:
    """Keep the values of the widgets `keys` through runs that don't draw them.

    Streamlit drops a widget's value at the end of any run that did not create the widget; the explorer draws
    only the open tab, so a colour chosen in the graph or an optimizer picked in the memory panel would be
    forgotten by opening another tab. Writing each value back makes it the user's own state, which persists.
    Widgets kept this way take their defaults from st.session_state.setdefault, not value=/index=, and are
    never buttons (a button's state cannot be written).
    """
    for key in keys:
        if key in st.session_state:
            st.session_state[key] = st.session_state[key]
