"""Full fine-tuning vs LoRA, side by side, in the Memory and FLOPs tabs: what LoRA saves (gradients, optimizer
state, weight-gradient GEMMs) and what it does not (the weights, most activations), from two captures."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from graphviz_core.analysis.finetuning import (
    FinetuneComparison,
    comparison_title,
    finetune_configs,
    finetune_label,
    finetune_table,
    tuned_twin,
)
from graphviz_core.capture.result import Capture
from graphviz_core.ui.capture_cache import get_captures
from graphviz_core.ui.format import escape_markdown, format_bytes, format_flops, literal_cells

# The rows each tab shows (FinetuneComparison.savings' first column).
MEMORY_ROWS = ("trainable parameters", "AccumulateGrad nodes", "weights (bytes)", "gradients (bytes)",
               "fp32 master weights (bytes)", "optimizer state (bytes)", "saved for backward (bytes)",
               "activation peak (bytes)", "step peak (bytes)")
FLOP_ROWS = ("AccumulateGrad nodes", "forward FLOPs", "backward FLOPs", "backward matmul FLOPs")


def _cell(what: str, value: int) -> str:
    if "(bytes)" in what:
        return format_bytes(value)
    if "FLOPs" in what:
        return format_flops(value)
    return f"{value:,}"


def _change(full: int, tuned: int) -> str:
    if full == tuned:
        return "same"
    if not full:
        return f"+{tuned:,}"
    return f"{tuned / full:.1%} of full"


def _both_captured(config, optimizer: str) -> FinetuneComparison | None:
    """Both captures through the shared captures, then their comparison; None while one is refused or cancelled."""
    captures = get_captures(list(finetune_configs(config)))
    return None if captures is None else finetune_table(config, optimizer, *captures)


def show_finetune_comparison(capture: Capture, rows: tuple[str, ...], key: str) -> None:
    """A button that captures full fine-tuning and LoRA (or this run's freezing) on meta and shows `rows`."""
    config = capture.config
    try:
        tuned = tuned_twin(config)
    except ValueError as exc:  # a family with no default LoRA targets (ResNet)
        st.markdown("##### Full fine-tuning vs LoRA")
        st.caption(f"LoRA side by side needs modules to adapt: {exc}")
        return
    st.markdown(f"##### {comparison_title(tuned)}")
    optimizer = st.session_state.get("memory.optimizer") or config.optimizer
    state_key = f"finetune.{key}::{config}::{optimizer}"
    # a button's label is Markdown: a glob's stars would turn italic
    if st.button(escape_markdown(f"Compare full fine-tuning with {finetune_label(tuned)}"), key=f"finetune.{key}.button"):
        st.session_state[state_key] = True
    result = _both_captured(config, optimizer) if st.session_state.get(state_key) else None
    if result is None:
        other = "with LoRA's adapters" if tuned.finetune == "lora" else "with this run's frozen parameters"
        st.caption("Captures this config twice on meta (shapes only, quick at any size): every parameter trained, "
                   f"and {other}; the table shows what fine-tuning fewer parameters saves and what it does not.")
        return
    table = [
        {"": what, result.full.label: _cell(what, full), result.tuned.label: _cell(what, tuned),
         "change": _change(full, tuned), "why": why}
        for what, full, tuned, why in result.savings() if what in rows
    ]
    st.table(literal_cells(pd.DataFrame(table)), hide_index=True)
    st.caption(
        f"{result.full.frozen_parameters:,} → {result.tuned.frozen_parameters:,} frozen parameters. A frozen weight "
        "gets no AccumulateGrad node, no gradient, no optimizer state and no weight-gradient GEMM; the forward still "
        "runs it, its layer still passes a gradient to its input where anything before it trains, and the "
        f"activations {'the adapters and ' if result.adapters else ''}the other ops need are saved as before."
    )
