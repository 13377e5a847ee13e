"""The explorer's Debug tab: gradient-flow debugging of the config's step (docs/debugging.md).

The step runs once more under the recorder and its gradient-flow watch (analysis.gradient_flow.debug_step: the same
weights, batch, autocast and LoRA as the capture, no optimizer step), and its findings are listed; one placed at a
node opens in that step's graph with the node selected and the path from the loss down to it ringed. Refused with
the analysis's own sentence where the step cannot run that way (meta, checkpointing). A compiled config's step runs
compiled, and a finding inside a compiled region is replayed eagerly by the analysis (its `eager_replay`)."""

from __future__ import annotations

import streamlit as st

from graphviz_core.export.render import METRICS
from graphviz_core.serve import work
from graphviz_core.ui import findings as shown
from graphviz_core.ui.capture_cache import get_result
from graphviz_core.ui.config_form import in_form_words
from graphviz_core.ui.format import escape_markdown

COLOURS = ("grad_norm", "time_s")


def show_debug(capture) -> None:
    config = capture.config
    st.caption("Where a NaN or inf started in backward, which trainable parameters got no gradient and why, dead "
               "units: the step run once more under the gradient-flow watch, with the same weights and batch "
               "(docs/debugging.md).")
    check = st.checkbox("Also check every op of the forward for NaN and inf (names the op that produced one; costs "
                        "more)", key="debug.forward")
    try:  # one debugged step per (config, forward check), shared by every session; queued, with Cancel
        done = get_result(*work.debugging(config, check), "the step under the gradient-flow watch")
    except ValueError as exc:
        st.info(escape_markdown(f"The Debug view cannot run this config: {in_form_words(str(exc), config.model)}"))
        return
    if done is None:  # cancelled: said above, with a button to run it again
        return
    result, graphs = done
    findings = result["findings"]
    checked = "; every op of the forward checked" if result["forward_checked"] else ""
    if not findings:
        st.success(escape_markdown(f"No finding: every gradient was finite and every trainable parameter got one"
                                   f"{checked}."))
    else:
        st.caption(escape_markdown(f"{len(findings)} finding{'s' if len(findings) != 1 else ''}{checked}."))
        shown.show_findings(findings)
    if not graphs:
        return
    at_nodes = shown.placed(findings, lambda f: graphs[f.get("backward", 0)] if f.get("backward", 0) < len(graphs) else None)
    labels = [shown.finding_label(f) for f, _ in at_nodes]
    if len(findings) > shown.PLACED_AT_MOST:
        st.caption(f"The list below offers the first {shown.PLACED_AT_MOST} of the {len(findings):,} findings.")
    row = st.columns([3, 1])
    chosen = row[0].selectbox("Open a finding at its node", labels, index=None, key="debug.finding",
                              placeholder="Choose a finding" if labels else "No finding is placed at a node",
                              disabled=not labels)
    colour = row[1].selectbox("Colour by", COLOURS, key="debug.colour", format_func=METRICS.get)
    pair = next((p for p, label in zip(at_nodes, labels, strict=True) if label == chosen), None)
    backward = pair[0].get("backward", 0) if pair else 0
    if pair:
        shown.show_gradients(pair[0])
    shown.show_recorded_graph(graphs[backward], pair[1] if pair else None, colour, title="the step, recorded",
                        subtitle=f"backward {backward}")
