"""Streamlit entry point: navigation over the pages in pages/.

No icons: Streamlit loads its Material icon font from fonts.gstatic.com, and the page must make no
request outside its own server (tests/test_browser.py checks).
"""

import streamlit as st

st.set_page_config(page_title="Backprop, visible", layout="wide")

navigation = st.navigation(
    [
        st.Page("pages/graph_explorer.py", title="Graph explorer", default=True),
        st.Page("pages/compare.py", title="Compare two configs"),
        st.Page("pages/toy_expressions.py", title="Toy expressions"),
        st.Page("pages/parallel.py", title="Beyond one GPU"),
    ]
)
navigation.run()
