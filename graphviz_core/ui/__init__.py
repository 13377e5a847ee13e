"""Streamlit helpers and views shared by the pages: the config form, the capture cache, each page's panels (graph,
memory, FLOPs, compare, parallel, plan, recordings, findings), navigation and links; and the browser harness that tests
and screenshots start the app with.

The only part of the package that imports Streamlit (tests/test_imports.py); pyvis is imported here and in
`graphviz_core.export.render`, nowhere else.
"""
