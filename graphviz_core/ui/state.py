"""Session state that outlives the widgets drawing it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import streamlit as st

# The panels' choices the explorer keeps while another tab is open (keep_widget_state). Here, not in the panels'
# modules, so that the explorer's first run need not import those (pandas, Altair: ~0.7 s on a cold server).
MEMORY_WIDGETS = ("memory.ckpt_device", "memory.budget_choice", "memory.budget_gib")
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


# Streamlit marks what the last run drew and this run has not drawn again as stale, but fades it only ~1 s into the
# run, over another second: while a new capture or simulation ran, the last config's figures stood undimmed under the
# progress line. This rule fades them at once.
DIM_STALE = "[data-stale='true'] { opacity: 0.33 !important; transition: none !important; }"


@contextlib.contextmanager
def dim_stale_results(recomputing: bool) -> Iterator[None]:
    """Around everything a page draws from its result: while the result is `recomputing` (not at hand), what the last
    run showed is dimmed at once, not ~1 s later. The rule sits in a slot of the page drawn on every run (so the
    elements after it keep their places) and is withdrawn when the page is drawn, so the next run, a quick one, does
    not start dimmed."""
    slot = st.empty()
    if recomputing:
        slot.html(f"<style>{DIM_STALE}</style><span hidden>recomputing</span>")
    try:
        yield
    finally:
        slot.empty()
