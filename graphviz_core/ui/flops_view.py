"""The "FLOPs and time" tab: where the FLOPs go (per layer, per category, per op family), the total against
6·N·tokens, the per-op GPT-2 derivation with fused and manual attention, and per-node time, achieved FLOP/s and
arithmetic intensity on a roofline against the device's measured peak."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from graphviz_core.analysis import flop_analysis as fa
from graphviz_core.analysis.flop_terms import terms_both_ways
from graphviz_core.capture.device_peak import DevicePeak, measure_peak
from graphviz_core.capture.result import Capture
from graphviz_core.ui.charts import category_scale, show_chart
from graphviz_core.ui.finetune_view import FLOP_ROWS, show_finetune_comparison
from graphviz_core.ui.format import (
    escape_markdown,
    flops_unit,
    format_bytes,
    format_flops,
    format_intensity,
    format_ratio,
    format_seconds,
    literal_cells,
)

GRAPH_SEARCH_KEY = "view.search"  # the graph tab's search box: setting it highlights nodes there
PASS_COLOURS = {"forward": "#4c78a8", "backward": "#e45756"}
NOT_COUNTED = "not counted"  # a FLOP cell whose ops have no FLOP formula (flop_analysis.NOT_COUNTED_NOTE), not 0
# The per-node tables' narrow columns, each as wide as its header (auto width fitted the values and cut
# "bytes moved" to "bytes move…" at 1280 px); node and module keep their auto width, which fits their values.
# The list of every node, a data grid (thousands of rows): its columns add up to the 786 px an expander holds at 1280
# px, so none is cut off at the right; a long node id or module ends in "…" (click the cell for the whole).
NODE_COLUMNS = {
    "node": st.column_config.TextColumn(width=150),
    "module": st.column_config.TextColumn(width=120),
    "category": st.column_config.TextColumn(width=90),
    "FLOPs": st.column_config.TextColumn(width=75, help="FLOPs of the aten ops that ran in this node's backward"),
    "time": st.column_config.TextColumn(width=65, help="measured, instrumentation included"),
    "achieved": st.column_config.TextColumn(width=90, help="FLOPs / (time − the instrumentation's overhead)"),
    "bytes moved": st.column_config.TextColumn(
        width=100, help="gradients read and written + tensors saved for it, parameters included"
    ),
    "intensity": st.column_config.TextColumn(width=95, help="FLOPs / bytes moved"),
}
NODE_COLUMNS_NOTE = ("FLOPs: the aten ops that ran in the node's backward · time: measured, instrumentation included · "
                     "achieved: FLOPs / (time − the instrumentation's overhead) · bytes moved: gradients read and written "
                     "plus the tensors saved for it, parameters included · intensity: FLOPs / bytes moved")


def _flop_cell(flop: int | None) -> str:
    return NOT_COUNTED if flop is None else format_flops(flop)


@st.fragment
def show_flops(capture: Capture) -> None:
    """A fragment: its widgets (top-N, both attentions, highlight) rerun this panel only, never the capture."""
    f = capture.flops
    ratio = fa.overall_ratio(capture)
    rule = fa.rule_of_thumb(capture)
    cols = st.columns(4)
    cols[0].metric("Forward FLOPs", format_flops(f.forward), help="every aten op the forward ran, counted by shape")
    cols[1].metric(
        "Backward FLOPs",
        format_flops(f.backward),
        help="every aten op that ran while backward ran, including gradient sums between nodes"
        + (" and checkpointing's recompute" if f.backward_recompute else ""),
    )
    left_out = ", ".join(ratio.left_out_families)
    # the all-ops ratio overstates only where it reads differently at the precision shown
    overstated = format_ratio(ratio.all_ops_ratio) != format_ratio(ratio.ratio)
    cols[2].metric(
        "Backward / forward",
        format_ratio(ratio.ratio),
        "folklore says 2.00×",
        delta_color="off", delta_arrow="off",
        help="backward FLOPs over forward FLOPs, both counting only the ops counted both ways"
        + (f": {left_out} have a backward FLOP formula but no forward one, so their backward is left out too"
           + (f" (with it the ratio would read {format_ratio(ratio.all_ops_ratio)}, overstated)" if overstated else "")
           if left_out else ""),
    )
    off = rule.not_applicable
    cols[3].metric(
        "Measured / rule of thumb",
        "n/a" if off else format_ratio(rule.measured_flop / rule.rule_flop if rule.rule_flop else None),
        None if off else f"rule {format_flops(rule.rule_flop)}",
        delta_color="off", delta_arrow="off",
        help=off or "forward + backward measured, divided by 6·N·tokens + the attention "
        "term; the gap is explained term by term below",
    )
    if ratio.left_out_families:
        *rest, last = ratio.left_out_families
        names = f"{', '.join(rest)} and {last}" if rest else last
        st.caption(
            f"Backward / forward = {format_flops(ratio.backward_flop)} / {format_flops(ratio.forward_flop)}, over the "
            f"ops counted both ways: {names} have a backward FLOP formula but no forward one (forward "
            f"{NOT_COUNTED}), so their {format_flops(ratio.left_out_backward_flop)} of backward is left out."
            + (f" Every counted backward over the forward would read {format_ratio(ratio.all_ops_ratio)}, overstated."
               if overstated else
               " That backward is too small to move the ratio at this precision.")
        )
    _per_layer(capture)
    _ratios(capture)
    _rule_of_thumb(rule)
    show_finetune_comparison(capture, FLOP_ROWS, "flops")
    _both_attentions(capture)
    _time_and_roofline(capture)


def _grouped_bars(data: pd.DataFrame, group: str, unit: str, order: list[str]) -> alt.Chart:
    """Forward and backward side by side per `group`, horizontal, in the given order."""
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X(f"{unit}:Q", title=unit),
            y=alt.Y(f"{group}:N", sort=order, title=None, axis=alt.Axis(labelLimit=240)),
            yOffset=alt.YOffset("pass:N", sort=list(PASS_COLOURS)),
            color=alt.Color(
                "pass:N",
                scale=alt.Scale(domain=list(PASS_COLOURS), range=list(PASS_COLOURS.values())),
                legend=alt.Legend(orient="bottom", title=None),
            ),
            tooltip=[alt.Tooltip(f"{group}:N"), alt.Tooltip("pass:N"), alt.Tooltip("FLOPs:N")],
        )
        .properties(height=alt.Step(16))  # per bar: two bars (forward, backward) per row
    )


def _per_layer(capture: Capture) -> None:
    st.markdown("##### Where the FLOPs go")
    layers = fa.flops_per_layer(capture)
    by_category = {k: v for k, v in capture.flops.backward_by_category.items() if v}
    largest = max([1, *(max(r.forward_flop, r.backward_flop) for r in layers), *by_category.values()])
    unit, divisor = flops_unit(largest)
    left, right = st.columns(2)
    rows = [
        {"layer": r.layer, "pass": name, unit: value / divisor, "FLOPs": format_flops(value)}
        for r in layers
        for name, value in (("forward", r.forward_flop), ("backward", r.backward_flop))
    ]
    left.caption(
        "Forward and backward per layer (modules grouped by layer index), in the order backward reaches them; ops "
        "outside every module (loss, embedding sum) and the engine's gradient sums where two paths meet come last."
    )
    if rows:
        show_chart(_grouped_bars(pd.DataFrame(rows), "layer", unit, [r.layer for r in layers]), left)
    right.caption("Backward per category of the node that ran it (the colours of the graph).")
    if by_category:
        data = pd.DataFrame(
            [{"category": k, unit: v / divisor, "FLOPs": format_flops(v)} for k, v in by_category.items()]
        )
        show_chart(
            alt.Chart(data)
            .mark_bar(stroke="#555", strokeWidth=0.5)
            .encode(
                x=alt.X(f"{unit}:Q", title=f"backward ({unit})"),
                y=alt.Y("category:N", sort="-x", title=None),
                color=alt.Color("category:N", scale=category_scale(by_category), legend=None),
                tooltip=["category:N", "FLOPs:N"],
            )
            .properties(height=alt.Step(26)),
            right,
        )
    else:
        right.caption("No backward FLOPs were counted in this run.")
    uncounted = fa.uncounted_categories(capture)
    if uncounted:
        right.caption(f"{', '.join(uncounted)}: {fa.NOT_COUNTED_NOTE} (missing from these bars and the totals, not zero).")


def _ratios(capture: Capture) -> None:
    st.markdown("##### Is backward really 2× forward?")
    st.caption(
        "The folklore: backward costs twice the forward. Measured per op family from the aten ops each pass ran: "
        "true for matmuls, not for a fused attention kernel (it recomputes q·kᵀ) nor for elementwise ops."
    )
    rows = fa.ratios_by_family(capture)
    st.table(  # st.table wraps long cells; st.dataframe cut "why" off at 1280 px
        literal_cells(pd.DataFrame(
            [
                {
                    "op family": r.family,
                    "forward": _flop_cell(r.forward_flop),
                    "backward": format_flops(r.backward_flop),
                    "measured backward / forward": format_ratio(r.ratio),
                    "expected": format_ratio(r.expected_ratio) if r.expected_ratio else "—",
                    "folklore": format_ratio(fa.FOLKLORE_RATIO),
                    "why": r.why,
                } | _frozen_linears(r, capture)
                for r in rows
            ]
        )),
        hide_index=True,
    )


def _frozen_linears(row: fa.FamilyRatio, capture: Capture) -> dict:
    """The linear layers' expected ratio where weights are frozen (LoRA, a freeze glob): 2× holds only for a trained
    weight; a frozen one's backward has no weight-gradient matmul."""
    frozen = capture.summary.frozen_parameter_count
    if row.family != fa.FAMILIES["aten.mm"] or not frozen:
        return {}
    total = frozen + capture.summary.parameter_count
    return {
        "expected": f"1.00× frozen, {format_ratio(row.expected_ratio)} trained",
        "why": f"{row.why}. Here {frozen:,} of the {total:,} parameters are frozen: a frozen weight gets no dW, so "
        "its layer's backward is dx alone (1× its forward), and nothing at all where its input needs no gradient "
        "either (layers below every trained weight)",
    }


def _rule_of_thumb(rule: fa.RuleOfThumb) -> None:
    st.markdown("##### The total against 6·N·tokens")
    if rule.not_applicable:
        st.caption(rule.not_applicable)
        return
    st.caption(
        f"Training costs about 6 FLOPs per parameter per token (2 forward, 4 backward) — here 6 × "
        f"{rule.parameters:,} parameters × {rule.tokens:,} tokens — plus attention's q·kᵀ and p·v, which no "
        "parameter counts (12·L·b·s²·h for forward and backward). The rows below add up exactly to the measurement."
        + (f" A mixture of experts: each token uses {rule.experts.per_token} of {rule.experts.count} experts per layer, "
           "so the rule's N overstates the work; the idle experts' share is taken out row by row."
           if rule.experts else "")
    )
    rows = [
        ("6·N·tokens", rule.six_n_tokens_flop, "the rule of thumb"),
        ("+ attention term 12·L·b·s²·h", rule.attention_flop, "dense q·kᵀ and p·v, forward and backward"),
        ("= rule of thumb", rule.rule_flop, ""),
        *(("gap: " + t.term.split(":")[0].split(" (")[0], t.flop, t.term) for t in rule.gap),
        ("= measured forward + backward", rule.measured_flop, "every aten op counted by shape"),
    ]
    st.table(
        literal_cells(pd.DataFrame(
            [
                {
                    "term": term,
                    "FLOPs": ("+" if flop > 0 and term.startswith("gap") else "") + format_flops(flop),
                    "why": why,
                }
                for term, flop, why in rows
            ]
        )),
        hide_index=True,
    )


def _both_attentions(capture: Capture) -> None:
    """The per-op backward derivation for GPT-2 (11 terms per layer, then the head and loss), measured with the
    fused kernel and with attention spelled out op by op."""
    from graphviz_core.ui.capture_cache import get_capture  # the panel asks for the other attention's capture

    config = capture.config
    if not config.family.gpt2_backward_terms:  # one line, not a heading over nothing
        st.caption("Backward FLOPs op by op, fused vs spelled-out attention: derived for the built-in GPT-2 family "
                   "only (pick it in the sidebar to see it).")
        return
    st.markdown("##### Backward FLOPs op by op: fused vs spelled-out attention (GPT-2)")
    other = "sdpa" if config.attention == "manual" else "manual"
    st.caption(
        "The textbook derivation of GPT-2's backward, one row per op (summed over layers), next to the nodes "
        "that ran it. Spelled-out (manual) attention matches the formula exactly; the fused kernel does q·kᵀ, "
        "softmax and p·v in one node and recomputes q·kᵀ in backward. Its figures are a dense count (every q·k "
        "pair, as torch's flop counter counts it): a causal kernel skips key blocks that are wholly masked, so "
        "the arithmetic it really does is less: about half at long sequences."
    )
    if not st.toggle(f"Also capture this config with {other} attention", key="flops.both_ways"):
        return
    twin = get_capture(config.replace(attention=other))
    if twin is None:
        return
    fused, manual = (capture, twin) if other == "manual" else (twin, capture)
    try:
        rows = terms_both_ways(fused, manual)
    except ValueError as exc:
        st.error(escape_markdown(exc))
        return

    def cell(v: int | None) -> str:
        return "—" if v is None else format_flops(v)

    st.table(
        literal_cells(pd.DataFrame(
            [
                {
                    "op": r.term,
                    "formula": r.formula,
                    "textbook": cell(r.textbook_flop),
                    "manual attention": cell(r.manual_flop),
                    f"fused ({fused.config.attention}), dense count": cell(r.fused_flop),
                    "note": r.note,
                }
                for r in rows
            ]
        )),
        hide_index=True,
    )


def _highlight(op: str, module: str) -> None:
    # The graph's search matches "op module" as one string, so this selects exactly that node's op in that module.
    st.session_state[GRAPH_SEARCH_KEY] = f"{op} {module}".strip()
    st.session_state["tab"] = "Graph"  # the explorer's tabs (key "tab"): show the graph with the node found


def _node_table(rows: list[fa.NodeCost]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "node": r.node,
                "module": r.module or "—",
                "category": r.category,
                "FLOPs": _flop_cell(r.flop),
                "time": format_seconds(r.time_s),
                "achieved": format_flops(r.flop_per_s, "FLOP/s"),
                "bytes moved": format_bytes(r.bytes_moved),
                "intensity": format_intensity(r.intensity_flop_per_byte),
            }
            for r in rows
        ]
    )


def _show_nodes(rows: list[fa.NodeCost]) -> None:
    """A few nodes as a table that wraps (st.table): every cell whole at 1280 px, where a data grid's eight columns
    ran past its right edge."""
    st.table(literal_cells(_node_table(rows)), hide_index=True)


def _time_and_roofline(capture: Capture) -> None:
    st.markdown("##### Time and achieved throughput per node")
    timed = capture.device != "meta"
    if not timed:
        st.info(
            "On the meta device nothing runs: there is no time and no achieved FLOP/s. FLOPs and arithmetic "
            "intensity come from shapes alone and are shown below; run on cpu or cuda to time the nodes."
        )
    overhead = fa.instrumentation_overhead_s(capture)
    if timed and overhead is not None:
        st.caption(
            f"Times are as measured, so each includes the instrumentation's own cost (timing hooks, FLOP counter): "
            f"about {format_seconds(overhead)} per node here, the median time of the shape nodes (views, "
            "transposes), which do no arithmetic. Achieved FLOP/s subtracts that overhead from each node's time."
        )
    elif timed:
        st.caption("Times are as measured, instrumentation included (no shape nodes here to measure its overhead).")
    st.session_state.setdefault("flops.top_n", 10)  # kept across tabs: no value=
    n = st.select_slider("Nodes to list", [5, 10, 20, 50], key="flops.top_n")
    by_flop = fa.top_nodes(capture, "flop", n)
    st.caption(f"Top {n} nodes by backward FLOPs")
    _show_nodes(by_flop)
    by_time = fa.top_nodes(capture, "time_s", n) if timed else []
    st.caption(f"Top {n} nodes by time" + ("" if timed else " — not measured on meta"))
    if by_time:
        _show_nodes(by_time)
    st.caption(NODE_COLUMNS_NOTE)
    choices = list(dict.fromkeys([*by_flop, *by_time]))
    if choices:
        row = st.columns([3, 1])
        picked = row[0].selectbox(
            "Find a node in the graph",
            choices,
            format_func=lambda r: f"{r.op} · {r.module or '(no module)'} · {_flop_cell(r.flop)}",
            key="flops.find",
        )
        if row[1].button(
            "Highlight in the graph", key="flops.highlight", on_click=_highlight, args=(picked.op, picked.module)
        ):
            st.rerun()  # the whole page, so the graph tab opens with the highlight
        st.caption(
            "Highlighted nodes get a pink border in the Graph tab (its search box holds the node's op and module)."
        )
    if timed:
        _roofline(capture)
    with st.expander("Every node: FLOPs, time, achieved FLOP/s, bytes moved, intensity"):
        st.caption(
            "Bytes moved: the gradients the node reads and writes plus the tensors saved for it (read back in "
            "backward), parameters included. Intensity = FLOPs / bytes moved."
        )
        st.dataframe(_node_table(fa.node_costs(capture)), hide_index=True, width="stretch", column_config=NODE_COLUMNS)


def _roofline(capture: Capture) -> None:
    st.markdown("##### Roofline")
    if st.button(
        "Measure the peak again",
        key="flops.remeasure",
        help="the peak is measured once per process; measure again if the machine was busy then",
    ):
        measure_peak.cache_clear()
    peak: DevicePeak | None = measure_peak(capture.device)
    if peak is None:
        return
    nodes = [r for r in fa.node_costs(capture) if r.flop_per_s and r.intensity_flop_per_byte]
    st.caption(
        f"Each dot is a node: FLOPs per byte it moves (x) against the FLOP/s it achieved (y), both log scale. The "
        f"roofs are this {peak.device}'s own, measured once per process: a {peak.matmul_n}×{peak.matmul_n} float32 "
        f"matmul at {format_flops(peak.flop_per_s, 'FLOP/s')} and a {format_bytes(peak.copy_bytes)} copy at "
        f"{format_bytes(peak.bytes_per_s)}/s. Left of the ridge "
        f"({format_intensity(peak.ridge_flop_per_byte)}) a node is memory-bound: it cannot beat bandwidth × intensity."
        f" {len(nodes)} of {capture.summary.nodes} nodes did arithmetic within a measurable time."
    )
    if not nodes:
        return
    unit, divisor = flops_unit(max(peak.flop_per_s, *(r.flop_per_s for r in nodes)), "FLOP/s")
    points = pd.DataFrame(
        [
            {
                "intensity (FLOP/B)": r.intensity_flop_per_byte,
                unit: r.flop_per_s / divisor,
                "category": r.category,
                "node": r.node,
                "module": r.module or "—",
                "FLOPs": format_flops(r.flop),
                "time": format_seconds(r.time_s),
            }
            for r in nodes
        ]
    )
    lo = min(points["intensity (FLOP/B)"].min(), peak.ridge_flop_per_byte) / 2
    hi = max(points["intensity (FLOP/B)"].max(), peak.ridge_flop_per_byte) * 2
    xs = [lo * (hi / lo) ** (i / 40) for i in range(41)]
    roof = pd.DataFrame(
        [{"intensity (FLOP/B)": x, unit: min(peak.flop_per_s, peak.bytes_per_s * x) / divisor} for x in xs]
    )
    x = alt.X("intensity (FLOP/B):Q", scale=alt.Scale(type="log"), title="arithmetic intensity (FLOP per byte)")
    y = alt.Y(f"{unit}:Q", scale=alt.Scale(type="log"), title=f"achieved ({unit})")
    line = alt.Chart(roof).mark_line(color="black", strokeDash=[4, 3]).encode(x=x, y=y)
    dots = (
        alt.Chart(points)
        .mark_circle(size=70, opacity=0.8)
        .encode(
            x=x,
            y=y,
            color=alt.Color(
                "category:N", scale=category_scale(sorted(points["category"])),
                legend=alt.Legend(orient="bottom", columns=4),
            ),
            tooltip=[
                "node:N",
                "module:N",
                "category:N",
                "FLOPs:N",
                "time:N",
                alt.Tooltip("intensity (FLOP/B):Q", format=".2f"),
            ],
        )
    )
    show_chart((line + dots).properties(height=380))
    slow = sum(1 for r in nodes if r.intensity_flop_per_byte < peak.ridge_flop_per_byte)
    above = sum(1 for r in nodes if r.flop_per_s > min(peak.flop_per_s, peak.bytes_per_s * r.intensity_flop_per_byte))
    best = max(r.flop_per_s for r in nodes) / peak.flop_per_s
    st.caption(roofline_summary(slow, len(nodes), best, above))


def roofline_summary(left_of_ridge: int, nodes: int, best_of_peak: float, above_roof: int) -> str:
    """The sentence under the roofline: how many of its `nodes` dots are memory-bound, the best share of the peak,
    and how many sit above the roof (the peak was measured while the machine was busier)."""
    if nodes == 1:
        where = "The one node sits " + ("left of the ridge (memory-bound)" if left_of_ridge else "right of the ridge")
    else:
        verb = "sits" if left_of_ridge == 1 else "sit"
        where = f"{left_of_ridge} of these {nodes} nodes {verb} left of the ridge (memory-bound)"
    return (
        f"{where}; the best reached {best_of_peak:.0%} of the matmul peak. Small shapes run far below the "
        "roof: per-call overhead dominates kernels this short."
        + (
            f" {above_roof} {'node sits' if above_roof == 1 else 'nodes sit'} above the roof: the microbenchmark ran while this machine was "
            "busier than during the capture, so read the roof as a lower bound, or measure it again."
            if above_roof
            else ""
        )
    )
