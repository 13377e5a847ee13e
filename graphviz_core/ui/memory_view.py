"""The Memory tab: the measured timeline and its peak, where the saved bytes are, the training step against
common accelerators, checkpointing side by side, and the largest batch or seq that fits a budget."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from graphviz_core.analysis.checkpointing import checkpointing_table, policy_configs
from graphviz_core.analysis.memory_breakdown import largest_saved_tensors, saved_bytes_by_layer
from graphviz_core.analysis.step_terms import step_parts
from graphviz_core.analysis.training_step import (
    ACCELERATORS,
    OPTIMIZER_NAMES,
    TrainingStep,
    accelerator_fits,
    training_step_of,
)
from graphviz_core.capture.result import Capture
from graphviz_core.capture.timeline import KINDS, sampled_steps
from graphviz_core.config import ModelConfig
from graphviz_core.serve import work
from graphviz_core.ui.capture_cache import asked_result, get_captures
from graphviz_core.ui.charts import show_chart
from graphviz_core.ui.finetune_view import MEMORY_ROWS, show_finetune_comparison
from graphviz_core.ui.format import bytes_unit, escape_markdown, format_bytes, format_flops, literal_cells

KIND_COLOURS = ["#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e", "#c7c7c7"]  # same order as KINDS
CUSTOM = "Custom (GiB)"
MIN_BUDGET_GIB, MAX_BUDGET_GIB = 0.01, 1_000_000  # a typed budget: 10 MiB to a million GiB


@st.fragment
def show_memory(capture: Capture) -> None:
    """A fragment: its widgets (budget, the two actions) rerun this panel only, never the capture. The optimizer is
    the config's (the form's Optimizer control): its state is what torch.optim kept after the capture's step."""
    timeline = capture.timeline
    optimizer = capture.config.optimizer
    step = training_step_of(capture)
    peak = timeline.peak
    cols = st.columns(4)
    cols[0].metric(
        "Peak memory",
        format_bytes(capture.memory.peak_bytes),
        help="Forward + backward, parameters included. CUDA: torch.cuda.max_memory_allocated. CPU and meta: every storage created and freed, "
        "tracked by a dispatch mode (the same count as PyTorch's MemTracker).",
    )
    cols[1].metric(
        "Activation peak",
        format_bytes(timeline.activation_peak_bytes),
        help="the most bytes live at one moment besides parameters and gradients",
    )
    cols[2].metric(
        "Saved + held",
        format_bytes(capture.memory.saved_bytes + capture.memory.checkpoint_held_bytes),
        f"saved {format_bytes(capture.memory.saved_bytes)}",
        delta_color="off", delta_arrow="off",
        help="tensors saved for backward plus the inputs checkpointed regions keep to recompute",
    )
    cols[3].metric(
        f"Step peak ({OPTIMIZER_NAMES[optimizer]})",
        format_bytes(step.step_peak_bytes),
        help="the larger of two moments: the forward + backward peak plus the optimizer's state (torch.optim's own, "
        "after one step) and fp32 master weights (16-bit dtypes); and the optimizer's update, when the weights, "
        "gradients, state and the update's own temporaries are live together",
    )
    _saved_above_activation_peak(capture)
    where = peak.label if peak.phase != "start" else "before the forward"
    st.text(
        f"Peak: {capture.memory.peak_bytes:,} bytes at step {peak.index} ({peak.phase}: {where}"
        + (f", module {peak.module}" if peak.module else "")
        + ")"
    )
    if capture.device.startswith("cuda"):
        st.caption(
            "On CUDA the peak is the allocator's; the timeline below tracks storages and samples "
            "torch.cuda.memory_allocated at every step (shown on hover)."
        )
    _timeline_chart(capture)
    _where_the_bytes_are(capture)
    _training_step(capture, step)
    show_finetune_comparison(capture, MEMORY_ROWS, "memory")
    _checkpointing(capture)
    _will_it_fit(capture)


def _saved_above_activation_peak(capture: Capture) -> None:
    """Why Saved + held can exceed the activation peak (resnet-tiny: 141.5 KiB against 137.4 KiB): autograd also saves
    tensors that existed before the forward and are not parameters, the model's buffers (BatchNorm's running
    statistics), while the timeline, and so its activation peak, counts only the storages the step creates."""
    saved_and_held = capture.memory.saved_bytes + capture.memory.checkpoint_held_bytes
    if saved_and_held <= capture.timeline.activation_peak_bytes:
        return
    kinds = (KINDS.index("saved activations"), KINDS.index("held for recompute"))
    tracked = max((sum(step.bytes_by_kind[k] for k in kinds) for step in capture.timeline.steps), default=0)
    if saved_and_held <= tracked:
        return
    st.caption(
        f"Saved + held is above the activation peak: autograd also saves {format_bytes(saved_and_held - tracked)} of "
        "tensors that existed before the forward and are not parameters (the model's buffers, such as BatchNorm's "
        "running statistics), and the activation peak counts only what the step itself creates."
    )


def _timeline_chart(capture: Capture) -> None:
    timeline = capture.timeline
    steps = sampled_steps(timeline)
    unit, divisor = bytes_unit(timeline.peak_bytes)
    st.markdown("##### Bytes live at every step")
    st.caption(
        "Forward ops in the order they ran, then backward nodes in the order the engine ran them. "
        "Hover a step to name it."
        + (
            f" {len(timeline.steps):,} steps, {len(steps):,} drawn (the highest of each run of neighbours)."
            if len(steps) < len(timeline.steps)
            else ""
        )
    )
    long = pd.DataFrame(
        [
            {"step": s.index, "kind": kind, unit: b / divisor}
            for s in steps
            for kind, b in zip(KINDS, s.bytes_by_kind, strict=True)
        ]
    )
    hover = pd.DataFrame(
        [
            {
                "step": s.index,
                "phase": s.phase,
                "node or op": s.label,
                "module": s.module or "—",
                "total": format_bytes(s.total_bytes),
                unit: s.total_bytes / divisor,
                **({"allocator": format_bytes(s.allocator_bytes)} if s.allocator_bytes is not None else {}),
            }
            for s in steps
        ]
    )
    x = alt.X("step:Q", title="step (forward ops, then backward nodes)")
    area = (
        alt.Chart(long)
        .mark_area()
        .encode(
            x=x,
            y=alt.Y(f"{unit}:Q", stack="zero", title=f"bytes live ({unit})"),
            color=alt.Color(
                "kind:N",
                scale=alt.Scale(domain=list(KINDS), range=KIND_COLOURS),
                sort=list(KINDS),
                legend=alt.Legend(title="kind", orient="bottom", columns=3),
            ),
            order=alt.Order("kind_order:Q"),
        )
        .transform_calculate(kind_order=f"indexof({list(KINDS)!r}, datum.kind)")
    )
    tooltip = [alt.Tooltip(c) for c in hover.columns if c != unit]
    pointer = alt.Chart(hover).mark_rule(strokeWidth=4, opacity=0.001).encode(x=x, tooltip=tooltip)
    peak = timeline.peak
    marks = pd.DataFrame(
        [
            {"step": peak.index, "label": f"peak {format_bytes(peak.total_bytes)}", unit: peak.total_bytes / divisor},
            {"step": timeline.forward_end_step, "label": "backward starts", unit: 0},
        ]
    )
    rules = alt.Chart(marks).mark_rule(strokeDash=[4, 3], color="black").encode(x="step:Q")
    labels = (
        alt.Chart(marks)
        .mark_text(align="left", dx=4, dy=-6, color="black")
        .encode(x="step:Q", y=alt.Y(f"{unit}:Q"), text="label:N")
    )
    show_chart((area + rules + labels + pointer).properties(height=320))


def _bar(data: pd.DataFrame, category: str, unit: str, sort: list[str] | None = None):
    height = max(160, 28 * len(data))
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X(f"{unit}:Q", title=f"saved for backward ({unit})"),
            y=alt.Y(f"{category}:N", sort=sort or "-x", title=None, axis=alt.Axis(labelLimit=240)),
            tooltip=[alt.Tooltip(f"{category}:N"), alt.Tooltip("size:N")],
        )
        .properties(height=min(height, 900))
    )


def _where_the_bytes_are(capture: Capture) -> None:
    st.markdown("##### Where the saved bytes are")
    by_layer = saved_bytes_by_layer(capture)
    by_category = capture.memory.saved_bytes_by_category
    if not by_layer:
        st.caption("Nothing is saved for backward in this run.")
        return
    unit, divisor = bytes_unit(max([*by_layer.values(), *by_category.values()]))
    left, right = st.columns(2)
    layers = pd.DataFrame([{"layer": k, unit: v / divisor, "size": format_bytes(v)} for k, v in by_layer.items()])
    left.caption("per layer (modules grouped by layer index, as in the FLOPs tab), in forward order: embeddings, "
                 "layers 0..N-1, final norm, head; the loss and glue last")
    show_chart(_bar(layers, "layer", unit, sort=list(by_layer)), left)
    categories = pd.DataFrame(
        [{"category": k, unit: v / divisor, "size": format_bytes(v)} for k, v in by_category.items()]
    )
    right.caption("per category of the node that keeps them")
    show_chart(_bar(categories, "category", unit), right)
    st.caption("The largest saved tensors (storages counted once; parameters are never counted)")
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "size": format_bytes(t.storage_bytes),
                    "shape": " × ".join(map(str, t.shape)) or "scalar",
                    "dtype": t.dtype,
                    "kept for": t.node,
                    "module": t.module or "—",
                }
                for t in largest_saved_tensors(capture)
            ]
        ),
        hide_index=True,
        width="stretch",
    )


def _training_step(capture: Capture, step: TrainingStep) -> None:
    """`step`: the training step of the config's optimizer (show_memory computed it); one row per term."""
    st.markdown(f"##### One training step ({OPTIMIZER_NAMES[step.optimizer]}"
                + (f", {step.autocast} autocast" if step.autocast != "none" else "") + ")")
    parts = step_parts(capture, step)
    st.table(  # st.table wraps long cells; st.dataframe cut "why" off at 1280 px
        literal_cells(pd.DataFrame([{"part": p, "bytes": format_bytes(b), "why": w} for p, b, w in parts])),
        hide_index=True,
    )
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "accelerator": f.name,
                    "capacity": format_bytes(f.capacity_bytes),
                    "step fits?": "yes" if f.fits else "no",
                    "free / short by": format_bytes(abs(f.headroom_bytes)),
                }
                for f in accelerator_fits(step.step_peak_bytes)
            ]
        ),
        hide_index=True,
        width="stretch",
    )
    st.caption("One device, no sharding; capacity as nvidia-smi reports it.")
    for note in capture.notes:  # how the step ran: autocast, the GradScaler, the optimizer's step
        st.caption(escape_markdown(note))


def _policies_captured(config: ModelConfig, device: str, step_time: float | None):
    """The policies' captures through the shared captures, then their table; None while one is refused or cancelled."""
    captures = get_captures(policy_configs(config, device))
    return None if captures is None else checkpointing_table(config, device, config.optimizer, captures, step_time)


def _checkpointing(capture: Capture) -> None:
    st.markdown("##### Checkpointing side by side")
    config = capture.config
    same_device = False
    if capture.device != "meta":
        same_device = st.checkbox(
            f"Capture on {capture.device} instead of meta (slower; real time)", key="memory.ckpt_device"
        )
    device = capture.device.partition(":")[0] if same_device else "meta"  # "cuda:N" is asked for as "cuda": placed anew
    measured = capture.time.forward_s + capture.time.backward_s if capture.time.forward_s is not None else None
    step_time = measured if capture.config.checkpoint == "none" else None
    key = f"memory.ckpt::{config}::{device}"
    if st.button("Compare the checkpointing policies", key=f"{key}.button"):
        st.session_state[key] = True
    result = _policies_captured(config, device, step_time) if st.session_state.get(key) else None
    if result is None:
        st.caption(
            "Captures this config once per checkpoint policy (on meta: shapes only, quick at any size) "
            "and puts them in one table."
        )
        return
    rows = []
    for r in result.rows:
        rows.append(
            {
                "checkpointing": r.policy,
                "saved for backward": format_bytes(r.saved_bytes),
                "held for recompute": format_bytes(r.held_bytes),
                "kept for backward (saved + held)": format_bytes(r.kept_for_backward_bytes),
                "activation peak": format_bytes(r.activation_peak_bytes),
                "step peak": format_bytes(r.step_peak_bytes),
                "recompute": f"{format_flops(r.recompute_flops)} ({r.recompute_over_forward:.0%} of a forward)"
                if r.recompute_flops
                else "—",
                "extra step time": "—"
                if not r.recompute_flops
                else f"+{r.extra_time_fraction:.1%}"
                + (f" (~{r.extra_time_s * 1e3:.0f} ms)" if r.extra_time_s is not None else ""),
            }
        )
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    none = result.row("none")
    unit, divisor = bytes_unit(max(r.step_peak_bytes for r in result.rows))
    chart = pd.DataFrame(
        [
            {"checkpointing": r.policy, "measure": m, unit: v / divisor, "size": format_bytes(v)}
            for r in result.rows
            for m, v in (
                ("kept for backward (saved + held)", r.kept_for_backward_bytes),
                ("activation peak", r.activation_peak_bytes),
                ("step peak", r.step_peak_bytes),
            )
        ]
    )
    show_chart(
        alt.Chart(chart)
        .mark_bar()
        .encode(
            x=alt.X(f"{unit}:Q", title=f"bytes ({unit})"),
            y=alt.Y("checkpointing:N", title=None, sort=[r.policy for r in result.rows]),
            yOffset=alt.YOffset("measure:N", sort=["saved + held", "activation peak", "step peak"]),
            color=alt.Color("measure:N", legend=alt.Legend(orient="bottom")),
            tooltip=["checkpointing", "measure", "size"],
        )
        .properties(height=90 * len(result.rows)),
    )
    lines = []
    for r in result.rows:
        if r.policy == "none":
            continue
        change = (
            (r.kept_for_backward_bytes - none.kept_for_backward_bytes) / none.kept_for_backward_bytes
            if none.kept_for_backward_bytes
            else 0
        )
        saved_change = (r.saved_bytes - none.saved_bytes) / none.saved_bytes if none.saved_bytes else 0
        lines.append(
            f"{r.policy}: saved + held {change:+.1%} against none (saved alone {saved_change:+.1%}); "
            f"recompute {format_flops(r.recompute_flops)} = {r.recompute_over_forward:.0%} of a forward."
        )
    st.text("\n".join(lines))
    family = result.config.family
    st.caption(
        "Why recompute is less than a forward: PyTorch's non-reentrant checkpoint re-runs a region only until it "
        "has rebuilt the last tensor the backward needs, then stops (early stop); ops after that (a block's last "
        "linear, whose output nothing saved) never run again, and parts of the model outside any region "
        "(embeddings, the final norm, the output layer) are never recomputed. Held for recompute: what a "
        "checkpointed region keeps itself, its inputs and the outputs a selective policy keeps. The policies: "
        + " ".join(f"{r.policy}: {family.checkpoint_note(r.policy, result.config)}." for r in result.rows)
    )


def _will_it_fit(capture: Capture) -> None:
    st.markdown("##### Will it fit?")
    left, right = st.columns(2)
    st.session_state.setdefault("memory.budget_choice", [*ACCELERATORS, CUSTOM][2])  # kept across tabs: no index=
    st.session_state.setdefault("memory.budget_gib", 80.0)
    choice = left.selectbox("Memory budget", [*ACCELERATORS, CUSTOM], key="memory.budget_choice")
    if choice != CUSTOM:  # the card's own figure, shown as the button below rounds it (one decimal)
        right.number_input(
            "Budget (GiB)",
            value=round(ACCELERATORS[choice] / 2**30, 1),
            format="%.1f",
            key=f"memory.budget_shown.{choice}",
            disabled=True,
            help=f"The card's memory as nvidia-smi reports it: {ACCELERATORS[choice] // 2**20:,} MiB = "
            f"{format_bytes(ACCELERATORS[choice])} (a box's “GB” are 10⁹ bytes). Pick {CUSTOM} to type another.",
        )
        budget = ACCELERATORS[choice]
    else:
        # No min/max on the widget: Streamlit would keep the last valid value under a red mark while the search
        # below ran with it; an entry out of range is refused here with a sentence instead.
        gib = right.number_input("Budget (GiB)", step=1.0, key="memory.budget_gib",
                                 help=f"{MIN_BUDGET_GIB} to {MAX_BUDGET_GIB:,} GiB")
        if not MIN_BUDGET_GIB <= gib <= MAX_BUDGET_GIB:
            st.error(f"Budget (GiB) must be between {MIN_BUDGET_GIB} and {MAX_BUDGET_GIB:,} GiB; got {gib:,.2f}. "
                     "Nothing is searched until it is.")
            return
        budget = int(gib * 2**30)
    config = capture.config
    optimizer = config.optimizer
    key = f"memory.fit::{config}::{budget}::{optimizer}"
    # queued with everyone's work, its progress and Cancel drawn while it runs; kept for this browser tab
    pressed = st.button(f"Find the largest batch and seq within {format_bytes(budget)}", key=f"{key}.button")
    result = asked_result(key, (*work.fit_search(config, budget, optimizer, capture.summary.parameter_count,
                                                 capture.summary.frozen_parameter_count),
                                f"the will-it-fit search of {config.model}") if pressed else None)
    if result is None:
        st.caption(
            "Bisection over shapes-only captures on meta: the training step's peak (as above, with the "
            "config's optimizer) must stay within the budget. Batch keeps this seq; seq keeps this batch."
        )
        return
    rows = []
    for policy in dict.fromkeys(r.policy for r in result.results):
        row = {"checkpointing": policy}
        for r in (r for r in result.results if r.policy == policy):
            name = "largest batch" if r.dimension == "batch" else f"largest seq at batch {config.batch}"
            row[f"{name} (measured)"] = _largest_text(r)
            row[f"{name} (closed form)"] = _predicted_text(r)
        rows.append(row)
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    st.caption(
        "Closed form: the same parameter, gradient and optimizer bytes plus layers × Korthikanti et al.'s "
        "activations per layer (none 34sbh, plus 5as²b for manual attention; selective-attention 34sbh; full 2sbh; no closed form for selective-ops or selective-ops-torchtitan; "
        "16-bit bytes scaled to the dtype). It ignores the logits and the loss, which the captures include (in 16 "
        "bits a transformers language model's loss copies the logits to float32, as transformers' own loss does: "
        "the copy, freed once the log-softmax exists, and the float32 log-softmax kept for backward take 4 B per "
        "token per vocabulary entry each)."
    )


def _largest_text(result) -> str:
    if result.weights_alone_exceed:
        return "none (weights, gradients and optimizer state alone exceed it)"
    if result.largest == 0:
        return "none (1 does not fit)"
    return f"{result.largest:,}" + (" (tool limit)" if result.at_limit else "")


def _predicted_text(result) -> str:
    return "—" if result.predicted_largest is None else f"{result.predicted_largest:,}"
