"""Streamlit helpers shared by the pages (config form, capture cache, summary, graph view).

Besides `graphviz_core.export.render`, this is the only part of the package that imports Streamlit.
"""
