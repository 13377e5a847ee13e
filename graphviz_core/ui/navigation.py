"""Keeps every page behind app.py's st.navigation, even when a page URL is the first request.

Because this project's pages live in `pages/` beside app.py (DESIGN.md's layout), Streamlit starts each
process in its legacy multipage mode: until some session has run app.py's `st.navigation`, a request for
`/toy_expressions` runs the page file on its own — no page config, the legacy sidebar list. A page that
finds itself run that way switches the process to app.py's navigation and reruns itself through it (the
page's id is the hash of its URL path in both modes, so the same page comes back).
"""

from __future__ import annotations

import sys

import streamlit as st
from streamlit.runtime.pages_manager import PagesManager


def run_through_app() -> None:
    """Call first in every page file. Only on a real server: AppTest resets the flag before every run (its
    reruns are legacy-mode by design), and a rerun there would drop the widget interaction under test."""
    under_app_test = "streamlit.testing.v1.app_test" in sys.modules  # never imported by a real server
    if PagesManager.uses_pages_directory and not under_app_test:
        PagesManager.uses_pages_directory = False  # what st.navigation does when app.py runs
        st.rerun()
