"""The toy-expression page's widgets: expression and values, the detach / backward-twice toggles ("Backprop as Graph Transformation"),
and a backward stepper."""

from __future__ import annotations

import math

import pandas as pd
import streamlit as st

from graphviz_core.export.render import render_html
from graphviz_core.toy.expressions import (
    EXPRESSION_PRESETS,
    Trace,
    gradient_text,
    number_text,
    parse_expression,
    step_table,
    trace_expression,
    trace_graph,
    variables_of,
)
from graphviz_core.ui.format import escape_markdown
from graphviz_core.ui.state import keep_widget_state
from graphviz_core.ui.vis_script import vis_src

KEY = "expr"

# The toy graph's own words: an expression has variables and operations, not parameters, modules or a loss.
TOY_LEGEND = {"elementwise": "arithmetic", "activation": "function", "accumulate_grad": "variable",
              "other": "numbers only"}
TOY_HINT = ("Arrows follow the gradient: from L (top) down to the variables. Boxes are operations, arithmetic "
            "(+ − × ÷ **) or a function (exp, relu, …), with their forward value; ovals are the variables, whose "
            ".grad adds up what arrives. An arrow shows the gradient it carries once backward has reached it. "
            "Click a node for details; scroll to zoom, drag to pan.")


# The preset box's answer once the expression or a value no longer matches any preset: it names no example it is not
EDITED = "(edited: your own expression)"


def _load_preset() -> None:
    if st.session_state[f"{KEY}.preset"] == EDITED:  # nothing to load: the box only says what the fields hold
        return
    text, values = EXPRESSION_PRESETS[st.session_state[f"{KEY}.preset"]]
    st.session_state[f"{KEY}.text"] = text
    for name, value in values.items():
        st.session_state[f"{KEY}.var.{name}"] = value
    st.session_state[f"{KEY}.step"] = 0
    st.session_state[f"{KEY}.detach"] = []


def _holds(preset: str) -> bool:
    """Whether the fields hold exactly this preset: its expression and each of its values."""
    text, values = EXPRESSION_PRESETS[preset]
    return st.session_state.get(f"{KEY}.text", "").strip() == text and all(
        st.session_state.get(f"{KEY}.var.{name}") == value for name, value in values.items()
    )


def expression_inputs() -> Trace | None:
    """Preset, expression, one input per variable and the two toggles; the trace, or None after st.error."""
    if f"{KEY}.preset" not in st.session_state:
        st.session_state[f"{KEY}.preset"] = next(iter(EXPRESSION_PRESETS))
        _load_preset()
    # Each variable keeps its value by name while the expression is edited, through a syntax error (a run that draws
    # no value boxes, whose widgets Streamlit would otherwise forget) and while a variable is out of the expression.
    keep_widget_state([k for k in st.session_state if str(k).startswith(f"{KEY}.var.")])
    st.session_state[f"{KEY}.preset"] = next((name for name in EXPRESSION_PRESETS if _holds(name)), EDITED)
    options = [*EXPRESSION_PRESETS, *([EDITED] if st.session_state[f"{KEY}.preset"] == EDITED else [])]
    st.selectbox("Preset", options, key=f"{KEY}.preset", on_change=_load_preset,
                 help="Worked examples from the articles “Transformer Math” and “Backprop as Graph Transformation”. Edit the "
                      "expression or "
                      "a value and the box says so; pick an example again to load it.")
    text = st.text_input("Expression", key=f"{KEY}.text",
                         help="numbers, variables, + - * / **, unary minus, parentheses, and "
                              "exp log sqrt tanh sigmoid relu sin cos abs")
    try:
        variables = variables_of(parse_expression(text))
    except ValueError as exc:
        st.error("Expression: " + escape_markdown(sentence(exc)))
        return None
    values = {}
    if variables:
        cols = st.columns(min(len(variables), 6))
        for i, name in enumerate(variables):
            st.session_state.setdefault(f"{KEY}.var.{name}", 1.0)
            values[name] = cols[i % len(cols)].number_input(escape_markdown(name), key=f"{KEY}.var.{name}", format="%g", step=0.5)
    left, right = st.columns(2)
    current = [v for v in st.session_state.get(f"{KEY}.detach", []) if v in variables]
    st.session_state[f"{KEY}.detach"] = current
    detach = left.multiselect("Detach a variable (its path disappears; its .grad stays None)", variables,
                              key=f"{KEY}.detach", help="x.detach(): a common way to stop gradients by accident "
                              "(“Backprop as Graph Transformation”).")
    twice = right.toggle("Run backward twice, no zeroing (.grad +=)", key=f"{KEY}.twice",
                         help="Backward twice without zeroing .grad: it adds up (+= not =), as when "
                              "optimizer.zero_grad() is forgotten (“Backprop as Graph Transformation”).")
    try:
        return trace_expression(text, values, detach=detach, backward_passes=2 if twice else 1)
    except ValueError as exc:
        st.error(escape_markdown(sentence(exc)))
        return None


def sentence(error: object) -> str:
    """An error as the page shows it: a sentence that begins with a capital letter (the core's errors begin in
    lower case, to follow "graphviz-core: " on the command line)."""
    text = str(error)
    return text[:1].upper() + text[1:]


PLAY_INTERVAL_S = 0.9  # one backward step per tick while playing


def _move(delta: int | None, total: int) -> None:
    step = st.session_state.get(f"{KEY}.step", 0)
    st.session_state[f"{KEY}.step"] = total if delta is None else min(max(step + delta, 0), total)
    st.session_state[f"{KEY}.playing"] = False  # stepping by hand pauses


def _toggle_play(total: int) -> None:
    playing = not st.session_state.get(f"{KEY}.playing", False)
    st.session_state[f"{KEY}.playing"] = playing
    if playing and st.session_state.get(f"{KEY}.step", 0) >= total:
        st.session_state[f"{KEY}.step"] = 0


def backward_stepper(trace: Trace) -> None:
    """Step controls, the graph with the current step highlighted, the step table ("Transformer Math"), and the final check."""
    total = len(trace.steps)
    if total == 0:
        # A constant, or every path detached: autograd runs no node, so a stepper would have nothing to step.
        st.markdown(f"**Forward:** L = {number_text(trace.value)}. There are no backward steps: no variable reaches L "
                    "through an operation autograd records (constants only, or every path detached).")
        return
    st.session_state[f"{KEY}.step"] = min(st.session_state.get(f"{KEY}.step", 0), total)
    if trace.non_finite_step is not None:
        st.warning(escape_markdown(trace.non_finite_sentence))
    # Streamlit sends a fragment's run_every to the browser only when the fragment is called from a full app
    # run; a fragment rerun (a click on one of its buttons, or a tick) keeps the timer of the last full run.
    # So the timer is decided here, remembered, and the fragment asks for a full run whenever Play/Pause (or
    # reaching the end) has made it wrong: st.rerun() from inside the fragment reruns the whole app.
    timer = PLAY_INTERVAL_S if st.session_state.get(f"{KEY}.playing", False) else None
    st.session_state[f"{KEY}.timer"] = timer

    @st.fragment(run_every=timer)
    def stepper() -> None:
        playing = st.session_state.get(f"{KEY}.playing", False)
        if playing != (st.session_state.get(f"{KEY}.timer") is not None):
            st.rerun()  # start or stop the timer with a full run
        if playing and st.session_state[f"{KEY}.step"] < total:
            st.session_state[f"{KEY}.step"] += 1
        if playing and st.session_state[f"{KEY}.step"] >= total:
            # The last step is drawn in this run; the next tick finds playing off and stops the timer. (Stopping
            # it here with st.rerun() would drop this run's drawing: the browser's slider would still hold the
            # previous step and send it back as if the user had moved it.)
            st.session_state[f"{KEY}.playing"] = False
        cols = st.columns([1, 1, 1, 1, 1.2])
        at = st.session_state[f"{KEY}.step"]  # the slider below shows this step: no way further back at 0, on at the end
        # Plain characters, not Material icons: those load a font from fonts.gstatic.com.
        cols[0].button("« Start", on_click=_move, args=(-total, total), width="stretch", disabled=at == 0)
        cols[1].button("‹ Previous", on_click=_move, args=(-1, total), width="stretch", disabled=at == 0)
        cols[2].button("Next ›", on_click=_move, args=(1, total), width="stretch", type="primary",
                       disabled=at >= total)
        cols[3].button("End »", on_click=_move, args=(None, total), width="stretch", disabled=at >= total)
        playing_now = st.session_state.get(f"{KEY}.playing")
        cols[4].button("❚❚ Pause" if playing_now else "▶ Play", on_click=_toggle_play, args=(total,), width="stretch")
        # No pause on a slider move: a tick sent before the last step arrived carries the slider's old value,
        # and pausing on it would stop Play by itself on a slow machine (it only repeats a step instead).
        step = st.slider("Backward step", 0, total, key=f"{KEY}.step",
                         help="0 = after the forward pass; each step is one autograd node running")
        current = trace.steps[step - 1] if step else None
        st.markdown(f"**Forward:** L = {number_text(trace.value)}. " + (
            f"**Step {step} of {total}:** `{current.op}` for **{escape_markdown(current.node)}** "
            f"(upstream gradient {number_text(current.upstream)})" if current else f"{total} backward steps to go."))
        broken = trace.non_finite_node(step)
        graph = trace_graph(trace, step)
        st.iframe(render_html(graph, title=f"L = {trace.expression}", subtitle="forward values on nodes, gradients on edges",
                              highlight={current.node, broken} - {None} if current else frozenset(), height_px=430,
                              hint=TOY_HINT, legend_labels=TOY_LEGEND, highlight_is_search=False, vis_src=vis_src()),
                  height=450)
        narrow = st.column_config.TextColumn(width="small")
        st.dataframe(pd.DataFrame(step_table(trace, step)), hide_index=True, width="stretch",
                     column_config={"pass": narrow, "step": narrow, "value": narrow,
                                    "computation": st.column_config.TextColumn(width="large")})
        if step == total:
            final_gradients(trace)
        else:
            st.caption("Step to the end to see the final gradients and their finite-difference check.")

    stepper()


def final_gradients(trace: Trace) -> None:
    st.subheader("Final gradients")
    # With two passes .grad holds twice one backward's gradient; the finite difference is one derivative, so it
    # is checked against what one pass gave.
    checked = trace.grads_after_each_pass[0] if trace.backward_passes == 2 else trace.grads
    rows = []
    for name in trace.values:
        grad, one_pass = trace.grads[name], checked[name]
        fd = trace.finite_differences[name]
        rows.append({
            "variable": name,
            "backprop (autograd)": "None (detached)" if grad is None else gradient_text(grad),
            "numerical (finite difference)": "none" if fd.value is None else number_text(fd.value, digits=9),
            "how": f"{fd.method}, h = {number_text(fd.step)}" if fd.value is not None else "no finite step",
            "|difference|" if trace.backward_passes == 1 else "|pass 1 − numerical|":
                "n/a" if one_pass is None or fd.value is None or not math.isfinite(one_pass) else
                (f"{abs(one_pass - fd.value):.2e}" + (" (kink: no derivative)" if fd.kink else "")),
        })
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    for name, fd in trace.finite_differences.items():
        if fd.kink:
            st.warning(f"**{escape_markdown(name)}:** " + escape_markdown(fd.note))
        elif fd.note:
            st.info(f"**{escape_markdown(name)}:** " + escape_markdown(fd.note))
    if trace.backward_passes == 2:
        first, second = trace.grads_after_each_pass
        st.info("Backward ran twice without zeroing: .grad accumulated (+=). After pass 1: "
                + escape_markdown(_grads_text(first)) + "; after pass 2: "
                + escape_markdown(_grads_text(second)) + ". Zeroing (optimizer.zero_grad()) "
                "between passes would leave the pass-1 values.")
    if trace.detached:
        st.info(f"Detached: {escape_markdown(', '.join(trace.detached))} — no path from L reaches it, so its .grad is None; the "
                "finite difference still moves L, which is exactly what detaching hides from the optimizer.")


def _grads_text(grads: dict[str, float | None]) -> str:
    return ", ".join(f"{name} = {'None' if g is None else number_text(g)}" for name, g in grads.items())
