"""Streamlit entry point: navigation over the pages in pages/."""

import streamlit as st

st.set_page_config(page_title="Backprop, visible", page_icon="🔁", layout="wide")

navigation = st.navigation(
    [
        st.Page("pages/graph_explorer.py", title="Graph explorer", icon="🕸️", default=True),
    ]
)
navigation.run()
