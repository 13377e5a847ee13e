"""The summary shown above the graph: counts and totals, and a table of nodes, bytes and FLOPs per category."""

from __future__ import annotations

from collections import Counter
from html import escape

import streamlit as st

from graphviz_core.analysis.flop_analysis import NOT_COUNTED_NOTE, uncounted_categories
from graphviz_core.analysis.memory_formulas import meta_layer_norm_statistics
from graphviz_core.capture.result import Capture
from graphviz_core.export.formats import CATEGORY_COLOURS
from graphviz_core.export.render import run_description
from graphviz_core.ui.format import escape_markdown, format_bytes, format_flops, format_seconds


def show_summary(capture: Capture) -> None:
    s, m, f, t = capture.summary, capture.memory, capture.flops, capture.time
    # Two rows of three: six metrics in one row cut values off ("28 te…", "677.8 …") at laptop widths.
    top, bottom = st.columns(3), st.columns(3)
    top[0].metric("Nodes", f"{s.nodes:,}", help="autograd nodes reached from the loss")
    top[1].metric("Edges", f"{s.edges:,}", help="gradient paths between nodes")
    frozen = f"; {s.frozen_parameter_count:,} frozen" if s.frozen_parameters else ""
    top[2].metric("Trainable parameters" if frozen else "Parameters", f"{s.parameter_count:,}",
                  f"in {s.parameters} tensors{frozen}", delta_color="off", delta_arrow="off",
                  help="trainable scalars the backward pass computes a gradient for (one AccumulateGrad node per "
                  "tensor)" + (f"; {s.frozen_parameter_count:,} more in {s.frozen_parameters} frozen tensors get no "
                               "gradient and no node" if frozen else ""))
    bottom[0].metric("Saved for backward", format_bytes(m.saved_bytes), help="storages de-duplicated, parameters excluded")
    bottom[1].metric("Backward FLOPs", format_flops(f.backward), f"forward {format_flops(f.forward)}", delta_color="off", delta_arrow="off")
    bottom[2].metric("Backward time", format_seconds(t.backward_s), f"forward {format_seconds(t.forward_s)}", delta_color="off", delta_arrow="off",
                     help="wall time on this device, instrumentation included (the FLOPs and time tab measures it)")
    if t.note():
        st.caption(":material/warning: " + t.note())
    # what produced every figure above: the same description as the graph's subtitle and the compare page's headers
    config = ("preset " + capture.config.preset + " · " if capture.config.preset else "") + run_description(
        capture.config, capture.device)
    if capture.loss is not None:
        st.caption(f"Loss {capture.loss:.4f} on {capture.device} · config: {escape_markdown(config)}")
    else:
        st.caption(f"meta device: shapes only — time, gradient norms and the loss value are not measured · config: "
                   f"{escape_markdown(config)}")
        norms, extra = meta_layer_norm_statistics(capture.graph, capture.device, capture.config.dtype)
        if norms:
            st.caption(
                f"Where this dry run and a CPU run differ: the meta kernel keeps each LayerNorm's mean and 1/std in "
                f"float32 (as CUDA does), the CPU kernel in {capture.config.dtype}; so a CPU run saves "
                f"{format_bytes(extra)} less ({norms} LayerNorms)."
            )


BAR_MAX_PCT = 70  # of the nodes column: the largest category's bar; its count sits after it


def category_rows(capture: Capture) -> list[dict]:
    """One row per category, most nodes first: its nodes, bar width (% of the column), fill, bytes saved, FLOPs
    (None where its ops have no FLOP formula: "not counted", not 0)."""
    s, m, f = capture.summary, capture.memory, capture.flops
    categories = set(s.by_category) | set(m.saved_bytes_by_category) | set(f.backward_by_category)
    most = max(s.by_category.values(), default=0) or 1
    uncounted = set(uncounted_categories(capture))
    rows = [{"category": c, "nodes": s.by_category.get(c, 0), "saved_bytes": m.saved_bytes_by_category.get(c, 0),
             "backward_flops": None if c in uncounted else f.backward_by_category.get(c, 0),
             "colour": CATEGORY_COLOURS.get(c, "#000000")}
            for c in categories]
    for row in rows:
        row["bar_pct"] = BAR_MAX_PCT * row["nodes"] / most
    return sorted(rows, key=lambda row: (-row["nodes"], row["category"]))


def show_categories(capture: Capture) -> None:
    """Per category: its nodes as a bar (in the graph's colour for it), the bytes it saved for backward and its
    backward FLOPs, in one HTML table (st.html: sanitised, no script).

    A Vega-Lite bar chart and a data grid showed the same numbers: their ~2 MB of browser script, loaded and run
    beside the graph's frame, delayed the first graph by ~0.85 s (benchmarks/trace_page.py, 9 tabs each)."""
    rows = category_rows(capture)
    cells = "".join(
        "<tr>"
        f"<td>{escape(row['category'])}</td>"
        f'<td><span style="display:inline-block;vertical-align:-1px;height:11px;width:{row["bar_pct"]:.1f}%;'
        f'min-width:2px;margin-right:6px;background:{escape(row["colour"])};border:1px solid #555"></span>'
        f"{row['nodes']:,}</td>"
        f'<td style="text-align:right">{escape(format_bytes(row["saved_bytes"]))}</td>'
        f'<td style="text-align:right">{_flops_cell(row["backward_flops"])}</td>'
        "</tr>"
        for row in rows
    )
    st.html(
        '<table style="width:100%;border-collapse:collapse;font-size:14px;line-height:22px" class="categories">'
        '<thead><tr style="text-align:left"><th style="width:22%">category</th><th>nodes</th>'
        '<th style="width:20%;text-align:right">saved for backward</th>'
        '<th style="width:20%;text-align:right">backward FLOPs</th></tr></thead>'
        f"<tbody>{cells}</tbody></table>"
    )
    if any(row["backward_flops"] is None for row in rows):
        st.caption(f"Backward FLOPs {NOT_COUNTED_NOTE} (they are missing from the totals, not zero).")
    note = spelled_out_attention_note(capture)
    if note:
        st.caption(escape_markdown(note))


# What each op of a spelled-out attention core does, by its op name without `Backward<N>`.
_CORE_ROLES = {"Bmm": "q·kᵀ, ·v", "Matmul": "q·kᵀ, ·v", "Mul": "scale", "Div": "scale", "MaskedFill": "mask",
               "Add": "mask", "Where": "mask", "Softmax": "softmax", "NativeDropout": "dropout"}


def spelled_out_attention_note(capture: Capture) -> str | None:
    """With attention spelled out (`manual`, `eager`): the core's attention nodes per layer and what each op does,
    beside the fused kernel's one node per layer; None otherwise."""
    config = capture.config
    family = config.family
    if not family.spelled_out_attention or config.attention != family.spelled_out_attention:
        return None
    ops = Counter(d["op"] for _, d in capture.graph.nodes(data=True) if d["category"] == "attention")
    if not ops:
        return None
    per_layer = all(n % config.layers == 0 for n in ops.values())
    layers = config.layers if per_layer else 1
    listed = []
    for op, n in ops.most_common():
        role = _CORE_ROLES.get(op.split("Backward")[0])
        listed.append(("" if n == layers else f"{n // layers} × ") + op + (f" ({role})" if role else ""))
    where = "per layer" if per_layer else "in all"
    return (f"Attention spelled out ({config.attention}): {sum(ops.values()) // layers} attention nodes {where}, "
            f"{', '.join(listed)}, where the fused kernel ({family.attentions[0]}) is one node per layer; the core's "
            "reshapes count as shape.")


def _flops_cell(flops: int | None) -> str:
    return '<span style="color:#666">not counted</span>' if flops is None else escape(format_flops(flops))
