"""Streamlit entry point: navigation over the pages in pages/.

No icons: Streamlit loads its Material icon font from fonts.gstatic.com, and the page must make no
request outside its own server (tests/test_browser.py checks).
"""

import threading

import streamlit as st

from graphviz_core.capture.device import resolve_device
from graphviz_core.capture.engine import warm_up
from graphviz_core.ui.routes import PAGE_CSS

st.set_page_config(page_title="Backprop, visible", layout="wide")


@st.cache_resource(show_spinner=False)
def _warm_up_in_background() -> threading.Thread:
    # Once per server: the process's one-time costs are paid beside the first page's form, not inside the first
    # capture's timed forward (a capture that starts meanwhile waits for it, then measures warm).
    thread = threading.Thread(target=warm_up, args=(resolve_device("auto"),), name="warm-up", daemon=True)
    thread.start()
    return thread


_warm_up_in_background()
# The pages' style (PAGE_CSS: no blank band above the title); served in each page's <head> too (ui.routes)
st.html(f"<style>{PAGE_CSS}</style>")

navigation = st.navigation(
    [
        st.Page("pages/graph_explorer.py", title="Graph explorer", default=True),
        st.Page("pages/compare.py", title="Compare two configs"),
        st.Page("pages/toy_expressions.py", title="Toy expressions"),
        st.Page("pages/parallel.py", title="Beyond one GPU"),
        st.Page("pages/recordings.py", title="Recordings"),
    ]
)
navigation.run()
