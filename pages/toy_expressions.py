"""Toy expressions: step through backprop on a scalar expression, value by value ("Transformer Math")."""

import streamlit as st

from graphviz_core.ui.expression_view import EDITED, KEY, backward_stepper, expression_inputs
from graphviz_core.ui.links import dismiss_notices, expression_link, restore_expression, show_notices
from graphviz_core.ui.navigation import run_through_app

run_through_app()
st.title("Backprop, one value at a time")
st.caption("Type any scalar expression; real torch autograd runs it, and each step below is one backward node.")
restore_expression(KEY, EDITED)  # a link's expression, values and toggles, once per session
show_notices(KEY)  # shown as the page opens; the next change to the page clears it
dismiss_notices(KEY)
trace = expression_inputs()
expression_link(KEY, st.sidebar)  # the link to this expression as it is now
if trace is not None:
    backward_stepper(trace)
