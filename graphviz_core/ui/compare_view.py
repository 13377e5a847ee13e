"""The compare page's parts: config A and config B (two keyed copies of the shared form), quick pairs that load
both at once, and the comparison side by side — headline deltas, nodes added/removed/changed per op and per
module, memory and FLOPs per layer as paired bars, the two graphs with their own nodes highlighted, and one
sentence per difference."""

from __future__ import annotations

import re
from collections.abc import Callable

import altair as alt
import pandas as pd
import streamlit as st

from graphviz_core.analysis.compare import Comparison, Headline, LayerPair, compare_captures, differing_fields
from graphviz_core.capture.result import Capture
from graphviz_core.config import (
    DEFAULT_PRESET,
    FAMILIES,
    LORA_ALPHA,
    LORA_RANK,
    ModelConfig,
    applies,
    config_from_preset,
)
from graphviz_core.export.render import render_html, run_description
from graphviz_core.fields import FIELDS
from graphviz_core.serve.shared_captures import shared_captures
from graphviz_core.ui.charts import show_chart
from graphviz_core.ui.config_form import config_form, in_form_words, set_config
from graphviz_core.ui.format import (
    bytes_unit,
    escape_markdown,
    flops_unit,
    format_bytes,
    format_flops,
    format_ratio,
    literal_cells,
)
from graphviz_core.ui.links import show_notices
from graphviz_core.ui.vis_script import vis_src
from graphviz_core.units import format_in

A, B = "compare.a", "compare.b"
DRAW_LIMIT = 1500  # nodes: above this the two graphs are not drawn side by side (the explorer draws one)
SIDE_COLOURS = {"A": "#4c78a8", "B": "#f58518"}


def _changed(base: ModelConfig, **changes) -> ModelConfig:
    """`base` with `changes`; it keeps its preset name only while it is still exactly that preset."""
    changed = base.replace(**changes)
    return changed if changed == base else changed.replace(preset="")


def _attention_pair(base: ModelConfig) -> tuple[ModelConfig, ModelConfig]:
    if not applies("attention", base.model):
        base = config_from_preset("gpt2-tiny")
    return _changed(base, attention="sdpa"), _changed(base, attention=base.family.spelled_out_attention)


def _checkpoint_pair(policy: str) -> Callable[[ModelConfig], tuple[ModelConfig, ModelConfig]]:
    def pair(base: ModelConfig) -> tuple[ModelConfig, ModelConfig]:
        other = policy if policy in base.family.checkpoint_policies() else "full"  # MLPs have no attention core
        return _changed(base, checkpoint="none"), _changed(base, checkpoint=other)

    return pair


def _one_change(a_fields: dict, b_fields: dict) -> Callable[[ModelConfig], tuple[ModelConfig, ModelConfig]]:
    """A pair of the training step as people run it: A is config A with `a_fields` (the reference, and whatever the
    change cannot run with), B is that A with only `b_fields` changed."""

    def pair(base: ModelConfig) -> tuple[ModelConfig, ModelConfig]:
        a = _changed(base, **a_fields)
        return a, _changed(a, **b_fields)

    return pair


def _compile_pair(base: ModelConfig) -> tuple[ModelConfig, ModelConfig]:
    if base.device == "meta":
        raise ValueError(
            "torch.compile runs the step on real tensors and config A runs on meta: set A's device to cpu or auto "
            "on a small model, or pick another pair."
        )
    return _one_change({"compile": False, "autocast": "none", "checkpoint": "none"}, {"compile": True})(base)


# The training step as people run it: B is A with one setting changed, and the sentence says what it changed.
TRAINING_PAIRS: dict[str, Callable[[ModelConfig], tuple[ModelConfig, ModelConfig]]] = {
    "fp32 vs bf16 autocast": _one_change(
        {"dtype": "float32", "autocast": "none", "compile": False}, {"autocast": "bfloat16"}
    ),
    "Full fine-tuning vs LoRA": _one_change(
        {"finetune": "full", "lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA, "lora_targets": "", "freeze": ""},
        {"finetune": "lora"},
    ),
    "Eager vs compiled": _compile_pair,
    "AdamW vs SGD": _one_change({"optimizer": "adamw"}, {"optimizer": "sgd"}),
}

# Label -> (A, B) from the config A holds now; each pair keeps A's other fields.
QUICK_PAIRS: dict[str, Callable[[ModelConfig], tuple[ModelConfig, ModelConfig]]] = {
    "Fused vs spelled-out attention": _attention_pair,
    "No checkpointing vs full": _checkpoint_pair("full"),
    "No checkpointing vs selective": _checkpoint_pair("selective"),
    "float32 vs bfloat16": lambda c: (_changed(c, dtype="float32"), _changed(c, dtype="bfloat16")),
    "Batch 1 vs 8": lambda c: (_changed(c, batch=1), _changed(c, batch=8)),
    "GPT-2 vs Llama (tiny)": lambda c: (config_from_preset("gpt2-tiny"), config_from_preset("llama-tiny")),
    "Llama 3.1 8B vs 70B (meta)": lambda c: (config_from_preset("llama-3.1-8b"), config_from_preset("llama-3.1-70b")),
    **TRAINING_PAIRS,
}


def config_summary(config: ModelConfig, device: str | None = None) -> str:
    """The preset's name, where it is one, then the description every page and picture uses (run_description)."""
    return " · ".join([*([config.preset] if config.preset else []), run_description(config, device)])


def _load_pair(label: str) -> None:
    try:
        base = st.session_state.get(f"{A}.applied") or config_from_preset(DEFAULT_PRESET)
        a, b = QUICK_PAIRS[label](base)
    except ValueError as exc:  # a pair this model cannot take (the config refuses it with a sentence)
        st.session_state["compare.pair_error"] = f"{label}: {exc}"
        return
    st.session_state.pop("compare.pair_error", None)
    set_config(A, a)
    set_config(B, b)


def pick_configs() -> tuple[ModelConfig, ModelConfig]:
    """Quick pairs, then A's and B's forms side by side; returns the two configs last applied."""
    if f"{A}.preset" not in st.session_state:  # first visit: the pair with the best-known difference
        _load_pair("Fused vs spelled-out attention")
    # What a link asked for and could not have: at the top, not only inside the collapsed forms below
    link_notices = st.container()
    st.caption("Quick pairs (built from config A's current fields):")
    labels = [label for label in QUICK_PAIRS if label not in TRAINING_PAIRS]
    # three a row: four cut 'Fused vs spelled-out atten…' and 'No checkpointing vs selec…' off at 1280 px
    pairs = st.container(key="compare-pairs")  # CSS class st-key-compare-pairs: the browser test finds the row
    for column, label in zip(pairs.columns(3) + pairs.columns(3) + pairs.columns(3), labels, strict=False):
        column.button(label, key=f"compare.pair.{label}", on_click=_load_pair, args=(label,), width="stretch")
    st.caption("The training step as people run it (B is A with that one setting changed):")
    training = st.container(key="compare-training-pairs")
    for column, label in zip(training.columns(len(TRAINING_PAIRS)), TRAINING_PAIRS, strict=True):
        column.button(label, key=f"compare.pair.{label}", on_click=_load_pair, args=(label,), width="stretch")
    if "compare.pair_error" in st.session_state:
        st.error(escape_markdown(st.session_state["compare.pair_error"]))
    configs = []
    for column, key, side in zip(st.columns(2), (A, B), "AB", strict=True):
        applied = st.session_state[f"{key}.applied"]
        with column.expander(f"Config {side}: {config_summary(applied)}"):
            configs.append(config_form(key, where=st.container(), submit_label=f"Use as {side}"))
        show_notices(key, link_notices, lead=f"Config {side}: ")
        if f"{key}.error" in st.session_state:  # a refused config, said above the comparison too: its form may be shut
            refused = in_form_words(st.session_state[f"{key}.error"], applied.model)
            link_notices.error(escape_markdown(f"Config {side} not used: {refused} The comparison shown is still that "
                                               "of the previous configs."))
    return configs[0], configs[1]


def get_comparison(a: Capture, b: Capture) -> Comparison:
    """The comparison of two captures, kept in the shared store for every session (the same pair is compared once;
    the captures themselves are kept there by config)."""
    store, key = shared_captures(), ("comparison", a.config, b.config, id(a), id(b))
    cached = store.lookup_key(key)
    if cached is not None:
        return cached.value
    comparison = compare_captures(a, b)
    store.keep(key, comparison, f"the comparison of {a.config.describe()} with {b.config.describe()}")
    return comparison


def _value(unit: str, v: float | None) -> str:
    return "n/a" if v is None else format_in(unit, v)


def _delta(h: Headline) -> str:
    d = h.delta
    if d is None:
        return "n/a"
    if d == 0:
        return "same"
    return ("+" if d > 0 else "-") + _value(h.unit, abs(d))


# An exact byte count in a sentence ("694,020 B", "+12,288 B"): 1 KiB and over, the cards' unit is added beside it
_EXACT_BYTES = re.compile(r"(?<![\w.,])([+-]?)(\d{1,3}(?:,\d{3})+) B\b")


def with_binary_units(sentence: str) -> str:
    """`sentence` with each exact byte count of 1 KiB or more followed by the cards' unit: "694,020 B (677.8 KiB)"."""
    def both(m: re.Match) -> str:
        n = int(m[2].replace(",", ""))
        return m[0] if n < 1024 else f"{m[0]} ({m[1]}{format_bytes(n)})"

    return _EXACT_BYTES.sub(both, sentence)


def changed_fields_table(c: Comparison) -> pd.DataFrame:
    """The config fields A and B differ in, each by its label (graphviz_core.fields) with its unit: what the sentences
    below explain."""
    rows = []
    model = c.b.config.model
    for name, (a, b) in differing_fields(c.a, c.b).items():
        field = FIELDS[name]  # every config field is declared there (tests/test_fields.py)
        label = FAMILIES[model].label(name) if model in FAMILIES else field.label
        rows.append({"field": label, "A": _field_value(field, a), "B": _field_value(field, b)})
    return pd.DataFrame(rows, columns=["field", "A", "B"])


def _field_value(field, value) -> str:
    """A field's value as the table shows it: with its unit, a 0 that stands for a default with that default, and
    "n/a" where that side's family has no such field."""
    if value is None:
        return "n/a"
    if field.zero and value == 0:
        return f"0 ({field.zero})"
    return f"{value} {field.unit}" if field.unit else str(value)


def show_comparison(c: Comparison) -> None:
    st.markdown("##### What changed, and why")
    changed = changed_fields_table(c)
    if len(changed):
        st.table(literal_cells(changed), hide_index=True)  # a data grid cut "adamw" to "adam" at 1280 px
    for sentence in c.explanations:
        st.markdown("- " + escape_markdown(with_binary_units(sentence)))
    cols = [*st.columns(3), *st.columns(3)[:2]]  # two rows: five in one cut values off at laptop widths
    one_compiled = c.a.config.compile != c.b.config.compile  # its layers' ops run inside one compiled node
    if c.nodes_per_layer_delta is not None and c.a.config.layers == c.b.config.layers and not one_compiled:
        cols[0].metric("Nodes per layer", f"{c.nodes_per_layer_delta:+d}", help="B − A, the same in every layer")
    else:
        cols[0].metric("Nodes", f"{c.b.summary.nodes:,}", _delta(c.headline[0]), delta_color="off", delta_arrow="off",
                       help="Autograd nodes in B's graph, and B − A. Under torch.compile a compiled region is one "
                            "node: the operations inside it still run, in its own backward graph." if one_compiled
                       else "Autograd nodes in B's graph, and B − A.")
    shown = {h.name: h for h in c.headline}
    for col, name in zip(
        cols[1:], ("Saved for backward", "Peak memory", "Backward FLOPs", "Forward + backward time"), strict=True
    ):
        h = shown[name]
        col.metric(
            f"{name} (B)",
            _value(h.unit, h.b),
            f"{_delta(h)} (A: {_value(h.unit, h.a)})",
            delta_color="off",
            delta_arrow="off",
        )
    disturbed = [f"{label} ran for only {capture.time.cpu_share:.0%} of its wall time"
                 for label, capture in (("A", c.a), ("B", c.b)) if capture.time.disturbed]
    if disturbed:
        st.info(
            "Time difference not reliable: " + " and ".join(disturbed) + " (it waited for a CPU core or for another "
            "session's Python on this server), so its time mostly measures that wait. The FLOPs and bytes above are "
            "exact; compare times only when neither capture is flagged, or run both again when the server is quiet.",
            icon=None,
        )
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "": h.name,
                    "A": _value(h.unit, h.a),
                    "B": _value(h.unit, h.b),
                    "B − A": _delta(h),
                    "B / A": format_ratio(h.b / h.a) if h.a and h.b is not None else "—",
                }
                for h in c.headline
            ]
        ),
        hide_index=True,
        width="stretch",
    )
    _node_diff(c)
    _per_layer_bars(c)
    _graphs(c)


def _count_table(rows, name: str) -> pd.DataFrame:
    return pd.DataFrame(
        [{name: r.name or "(no module)", "A": r.a_nodes, "B": r.b_nodes, "B − A": r.delta} for r in rows]
    )


def _node_diff(c: Comparison) -> None:
    st.markdown("##### Nodes added, removed and changed")
    st.caption(
        f"Nodes are matched by module, op and position among that module's nodes of the same op. Only in A: "
        f"{len(c.only_a):,}; only in B: {len(c.only_b):,}; in both with different saved bytes or FLOPs: "
        f"{len(c.changed):,}."
    )
    if not c.by_op and not c.by_module:
        st.caption("Every op and every module has the same number of nodes in A and B.")
    else:
        # One under the other, each the page's width: side by side at a laptop's width (1280 px) long op names and
        # module paths would be cut; the counts need little room.
        counts = {column: st.column_config.NumberColumn(width="small") for column in ("A", "B", "B − A")}
        if c.by_op:
            st.caption("Per op (only ops whose count differs)")
            st.dataframe(_count_table(c.by_op, "op"), hide_index=True, width="stretch",
                         column_config={"op": st.column_config.TextColumn(width="large"), **counts})
        if c.by_module:
            st.caption("Per module (only modules whose count differs)")
            st.dataframe(_count_table(c.by_module, "module"), hide_index=True, width="stretch",
                         column_config={"module": st.column_config.TextColumn(width="large"), **counts})
    if c.changed:
        with st.expander(f"{len(c.changed):,} matched nodes whose saved bytes or FLOPs differ"):
            rows = []
            for ch in c.changed[:500]:
                da, db = c.a.graph.nodes[ch.a_node], c.b.graph.nodes[ch.b_node]
                rows.append(
                    {
                        "node (A)": ch.a_node,
                        "module": da["module"] or "—",
                        "saved A": format_bytes(da["saved_bytes"]),
                        "saved B": format_bytes(db["saved_bytes"]),
                        "FLOPs A": format_flops(da["flops"]),
                        "FLOPs B": format_flops(db["flops"]),
                    }
                )
            st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
            if len(c.changed) > 500:
                st.caption(f"The first 500 of {len(c.changed):,}, in A's numbering from the loss.")


def _paired(data: pd.DataFrame, unit: str, order: list[str], title: str) -> alt.Chart:
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X(f"{unit}:Q", title=f"{title} ({unit})"),
            # the domain sets the rows and their order: a gap row, which has no bar, is drawn empty with its label
            y=alt.Y("layer:N", scale=alt.Scale(domain=order), title=None, axis=alt.Axis(labelLimit=300)),
            yOffset=alt.YOffset("config:N", sort=["A", "B"]),
            color=alt.Color(
                "config:N",
                scale=alt.Scale(domain=list(SIDE_COLOURS), range=list(SIDE_COLOURS.values())),
                legend=alt.Legend(orient="bottom", title=None),
            ),
            tooltip=["layer:N", "config:N", "value:N"],
        )
        .properties(height=alt.Step(12))
    )


DRAW_ENDS = 20  # rows drawn at each end when there are more than twice as many (an 80-layer model)


def _span(first: str, last: str) -> str:
    """'model.layers.19 – 64' for two layers of one stack, else 'first – last'."""
    head_first, _, tail_first = first.rpartition(".")
    head_last, _, tail_last = last.rpartition(".")
    if head_first and head_first == head_last and tail_first.isdigit() and tail_last.isdigit():
        return f"{first} – {tail_last}"
    return f"{first} – {last}"


def layer_rows(c: Comparison) -> tuple[list[LayerPair], list[str], str]:
    """The per-layer rows to draw, the y axis's order (with a gap row where rows are left out) and the caption.

    Rows run in forward order (`Comparison.per_layer`). Past 2 × DRAW_ENDS rows the repeated layers read the same, so
    the first and the last DRAW_ENDS are drawn and one labelled row between them stands for the rest."""
    rows = list(c.per_layer)
    order = [p.layer for p in rows]
    if len(rows) <= 2 * DRAW_ENDS:
        return rows, order, "In forward order: the embeddings first, then each layer, the head, the loss last."
    left_out = rows[DRAW_ENDS:-DRAW_ENDS]
    span = _span(left_out[0].layer, left_out[-1].layer)
    gap = f"… {len(left_out)} not drawn: {span} …"
    in_a = sum(1 for p in left_out if p.a_nodes or p.a_saved_bytes or p.a_flop)
    in_b = sum(1 for p in left_out if p.b_nodes or p.b_saved_bytes or p.b_flop)
    caption = (
        f"{len(rows)} rows (layers, embeddings, head, loss) in forward order, too many to draw: the first {DRAW_ENDS} "
        f"and the last {DRAW_ENDS} are drawn, and the row “… {len(left_out)} not drawn …” stands for the "
        f"{len(left_out)} between them ({left_out[0].layer} – {left_out[-1].layer}): {in_a} of A's and {in_b} of B's."
    )
    drawn = rows[:DRAW_ENDS] + rows[-DRAW_ENDS:]
    return drawn, [*order[:DRAW_ENDS], gap, *order[-DRAW_ENDS:]], caption


def _per_layer_bars(c: Comparison) -> None:
    st.markdown("##### Memory and FLOPs per layer, A next to B")
    layers, order, caption = layer_rows(c)
    st.caption(escape_markdown(caption))
    byte_unit, byte_div = bytes_unit(max([1, *(max(p.a_saved_bytes, p.b_saved_bytes) for p in layers)]))
    flop_unit, flop_div = flops_unit(max([1, *(max(p.a_flop, p.b_flop) for p in layers)]))
    memory = pd.DataFrame(
        [
            {"layer": p.layer, "config": side, byte_unit: v / byte_div, "value": format_bytes(v)}
            for p in layers
            for side, v in (("A", p.a_saved_bytes), ("B", p.b_saved_bytes))
        ]
    )
    flops = pd.DataFrame(
        [
            {"layer": p.layer, "config": side, flop_unit: v / flop_div, "value": format_flops(v)}
            for p in layers
            for side, v in (("A", p.a_flop), ("B", p.b_flop))
        ]
    )
    left, right = st.columns(2)
    left.caption("Saved for backward per layer")
    show_chart(_paired(memory, byte_unit, order, "saved"), left)
    right.caption("Forward + backward FLOPs per layer")
    show_chart(_paired(flops, flop_unit, order, "FLOPs"), right)


def _graphs(c: Comparison) -> None:
    st.markdown("##### The two graphs")
    largest = max(c.a.summary.nodes, c.b.summary.nodes)
    if largest > DRAW_LIMIT:
        st.caption(
            f"Not drawn here: {largest:,} nodes is over {DRAW_LIMIT:,} per graph for two side by side. Open either "
            "config in the graph explorer to draw it."
        )
        return
    st.caption("Nodes only in this config have a pink border.")
    tab_b, tab_a = st.tabs([f"B: {len(c.only_b):,} nodes only in B", f"A: {len(c.only_a):,} nodes only in A"])
    for tab, capture, own in ((tab_b, c.b, c.only_b), (tab_a, c.a, c.only_a)):
        with tab:
            config = capture.config
            st.iframe(
                render_html(
                    capture.graph,
                    title=f"{config.preset or config.model}: {len(own):,} nodes only here",
                    subtitle=config_summary(config, capture.device),
                    highlight=set(own),
                    vis_src=vis_src(),
                ),
                height=790,
            )
