"""Toy expressions: step through backprop on a scalar expression, value by value ("Transformer Math")."""

import streamlit as st

from graphviz_core.ui.expression_view import backward_stepper, expression_inputs
from graphviz_core.ui.navigation import run_through_app

run_through_app()
st.title("Backprop, one value at a time")
st.caption("Type any scalar expression; real torch autograd runs it, and each step below is one backward node.")
trace = expression_inputs()
if trace is not None:
    backward_stepper(trace)
