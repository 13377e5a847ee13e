"""Charts at the height they were drawn for, in the graph's colours."""

from __future__ import annotations

from collections.abc import Iterable

import altair as alt
import streamlit as st

from graphviz_core.export.formats import CATEGORY_COLOURS

AXES_PX = 80  # axis titles, tick labels and a legend row below the plot


def category_scale(categories: Iterable[str]) -> alt.Scale:
    """A colour scale giving each category the graph's fill colour for it (export.CATEGORY_COLOURS), so a chart's
    "matmul" is the same blue as the graph's matmul nodes. Categories keep their order, once each."""
    domain = list(dict.fromkeys(categories))
    return alt.Scale(domain=domain, range=[CATEGORY_COLOURS.get(c, "#000000") for c in domain])


def show_chart(chart: alt.TopLevelMixin, where=None) -> None:
    """st.altair_chart with the element as tall as the chart's own height (+ its axes).

    Streamlit's default element height ("content") drew charts at about half the height set with
    .properties(height=…), so a bar chart of seven layers showed every other label.
    """
    height = chart.height if isinstance(chart.height, int) else None
    (where or st).altair_chart(chart, width="stretch", height=height + AXES_PX if height else "content")
