"""Charts at the height they were drawn for."""

from __future__ import annotations

import altair as alt
import streamlit as st

AXES_PX = 80  # axis titles, tick labels and a legend row below the plot


def show_chart(chart: alt.TopLevelMixin, where=None) -> None:
    """st.altair_chart with the element as tall as the chart's own height (+ its axes).

    Streamlit's default element height ("content") drew charts at about half the height set with
    .properties(height=…), so a bar chart of seven layers showed every other label.
    """
    height = chart.height if isinstance(chart.height, int) else None
    (where or st).altair_chart(chart, width="stretch", height=height + AXES_PX if height else "content")
