"""Runs captures for the pages: cached per config, with progress, and errors shown as sentences."""

from __future__ import annotations

import threading
from collections import OrderedDict

import streamlit as st

from graphviz_core.capture import Capture, capture_backward
from graphviz_core.config import ModelConfig
from graphviz_core.ui.format import escape_markdown, format_seconds

MAX_CACHED = 8


@st.cache_resource
def _store() -> dict:
    # Shared by every session in this process: the same config is captured once.
    return {"lock": threading.Lock(), "captures": OrderedDict()}


def get_capture(config: ModelConfig) -> Capture | None:
    """The capture of `config` (cached); None after showing an st.error when it cannot run."""
    store = _store()
    with store["lock"]:
        if config in store["captures"]:
            store["captures"].move_to_end(config)
            return store["captures"][config]
    try:
        with st.status("Capturing the backward pass…", expanded=False) as status:
            capture = capture_backward(config, progress=lambda phase: status.update(label=phase.capitalize() + "…"))
            took = (capture.time.forward_s or 0) + (capture.time.backward_s or 0)
            status.update(
                label=f"Captured {capture.summary.nodes:,} nodes on {capture.device}"
                + (f" in {format_seconds(took)}" if capture.time.forward_s is not None else " (shapes only)"),
                state="complete",
            )
    except ValueError as exc:
        st.error(escape_markdown(exc))
        return None
    with store["lock"]:
        store["captures"][config] = capture
        while len(store["captures"]) > MAX_CACHED:
            store["captures"].popitem(last=False)
    return capture
