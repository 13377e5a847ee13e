"""Recordings: a user's own training loop, recorded with graphviz_core.record, opened step by step (docs/recording.md)."""

import streamlit as st

from graphviz_core.ui.navigation import run_through_app
from graphviz_core.ui.recordings_view import pick_recording, show_recording

run_through_app()
st.title("Recordings of your own training loop")
st.caption("Loss, gradient norms and updates per layer, step after step, and each step's autograd graph with the "
           "figures it recorded. Record a loop with graphviz_core.record or graphviz-core record (docs/recording.md).")
recording = pick_recording()
if recording is not None:
    show_recording(recording)
