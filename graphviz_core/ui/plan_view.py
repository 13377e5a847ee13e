"""The "Plan" tab of Beyond one GPU: which layouts of the model fit on N GPUs, ranked (graphviz_core.parallel.planner)."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from graphviz_core.config import ModelConfig
from graphviz_core.parallel.planner import MAX_GLOBAL_BATCH, Cluster, parse_bytes, rate_problem
from graphviz_core.parallel.settings import GPUS_PER_NODE, H100_FLOPS, INFINIBAND_BYTES_PER_S, NVLINK_BYTES_PER_S
from graphviz_core.serve import work
from graphviz_core.ui.capture_cache import asked_result
from graphviz_core.ui.charts import show_chart
from graphviz_core.ui.format import bytes_unit, escape_markdown, format_bytes, format_seconds, literal_cells

KEY = "plan"
MESH_WORDS = {"dp_shard": "FSDP", "dp_replicate": "replicas", "tp": "TP", "pp": "PP", "cp": "CP"}
POLICY_WORDS = {"none": "none: keep every activation", "full": "full: keep each layer's input, re-run the layer",
                "selective-ops": "selective-ops: keep matmul and attention outputs",
                "selective-ops-torchtitan": "selective-ops-torchtitan: torchtitan's policy, keep every second matmul's "
                "and the attention outputs",
                "selective-attention": "selective-attention: re-run the attention core"}
WHOLE_FIELDS = {"gpus": ("GPUs in all", 1, 4096),
                "batch": ("Global batch (sequences per optimizer step)", 1, MAX_GLOBAL_BATCH),
                "per_node": ("GPUs per node", 1, 64)}
# field: (label, the Cluster's field, the unit the box is in)
RATE_FIELDS = {"tflops": ("GPU TFLOP/s (dense)", "gpu_flops", 1e12),
               "nvlink": ("NVLink GB/s per GPU", "nvlink_bytes_per_s", 1e9),
               "infiniband": ("Network GB/s per GPU", "infiniband_bytes_per_s", 1e9)}


def _inputs(config: ModelConfig) -> dict | None:
    """The cluster and what to try; the inputs once "Plan the layouts" is pressed, else None."""
    policies = config.family.checkpoint_policies()
    with st.form(f"{KEY}.form"):
        cols = st.columns(4)
        gpus = cols[0].number_input("GPUs in all", value=8, step=1, key=f"{KEY}.gpus")
        memory = cols[1].text_input("Memory per GPU", value="80GiB", key=f"{KEY}.memory",
                                    help="With its unit: 80GiB (H100 80GB), 141GB (H200), 24GiB.")
        batch = cols[2].number_input("Global batch (sequences per optimizer step)", value=16, step=1, key=f"{KEY}.batch")
        per_node = cols[3].number_input("GPUs per node", value=GPUS_PER_NODE, step=1,
                                        key=f"{KEY}.per_node",
                                        help="Tensor parallelism stays inside a node (NVLink); the rest may cross.")
        cols = st.columns(4)
        tflops = cols[0].number_input("GPU TFLOP/s (dense)", value=H100_FLOPS / 1e12,
                                      key=f"{KEY}.tflops", help="H100 SXM BF16: 989.4.")
        nvlink = cols[1].number_input("NVLink GB/s per GPU", value=NVLINK_BYTES_PER_S / 1e9,
                                      key=f"{KEY}.nvlink", help="Each way, inside a node. H100 SXM: 450.")
        infiniband = cols[2].number_input("Network GB/s per GPU", value=INFINIBAND_BYTES_PER_S / 1e9,
                                          key=f"{KEY}.infiniband", help="Each way, between nodes. 400 Gb/s NDR: 50.")
        sizes = cols[3].multiselect("Sequences per microbatch", [1, 2, 4, 8], default=[1], key=f"{KEY}.sizes")
        cols = st.columns(3)
        checkpoints = cols[0].multiselect("Checkpointing to try", policies, default=[p for p in ("none", "full")
                                                                                     if p in policies],
                                          key=f"{KEY}.checkpoints", help="; ".join(POLICY_WORDS.values()))
        pp = cols[1].multiselect("Pipeline stages to try", [1, 2, 4, 8], default=[1, 2], key=f"{KEY}.pp")
        cp = cols[2].multiselect("Context-parallel ranks to try", [1, 2, 4, 8], default=[1], key=f"{KEY}.cp",
                                 help="Ranks that split each sequence. Tensor-parallel layouts run sequence parallel "
                                 "wherever the model's family declares it (docs/parallel.md, the family table), as torchtitan does.")
        # a row of its own: in the third column its label was cut at 1280 px
        cp_with_pp = st.checkbox("Context parallel with pipeline stages too", value=False, key=f"{KEY}.cp_with_pp",
                                 help="Also try each context-parallel degree above 1 together with each pipeline "
                                 "degree above 1: every such layout is a pipeline simulation, the slowest kind.")
        pressed = st.form_submit_button("Plan the layouts")
    if not pressed:
        return None
    return {"gpus": int(gpus), "memory": memory, "batch": int(batch), "per_node": int(per_node), "tflops": tflops,
            "nvlink": nvlink, "infiniband": infiniband, "sizes": tuple(sizes), "checkpoints": tuple(checkpoints),
            "pp": tuple(pp), "cp": tuple(cp), "cp_with_pp": bool(cp_with_pp)}


def out_of_range(inputs: dict) -> list[str]:
    """A sentence for each number outside its range, naming the field by its label. The widgets take any number
    (with min/max set, Streamlit kept the last value in range without a word and the plan ran on that one)."""
    problems = [f"{label} must be a whole number from {low:,} to {high:,} (got {inputs[name]:,})."
                for name, (label, low, high) in WHOLE_FIELDS.items() if not low <= inputs[name] <= high]
    # a rate is finite and inside the planner's range: 1e-320 TFLOP/s showed as 0.00, passed "above 0" and its step
    # time overflowed the page's formatting
    rates = (rate_problem(field, inputs[name], label, scale) for name, (label, field, scale) in RATE_FIELDS.items())
    return problems + [problem[:1].upper() + problem[1:] for problem in rates if problem]


def _asked(config: ModelConfig, inputs: dict):
    """The plan `inputs` ask for, as (key, work, what) for the shared store; None after an st.error."""
    if problems := out_of_range(inputs):
        st.error(escape_markdown("Not planned: " + " ".join(problems)))
        return None
    for name, words in (("sizes", "a microbatch size"), ("checkpoints", "a checkpointing policy"),
                        ("pp", "a number of pipeline stages"), ("cp", "a number of context-parallel ranks")):
        if not inputs[name]:
            st.error(f"Pick at least {words} to try.")
            return None
    try:
        cluster = Cluster(gpus=inputs["gpus"], gpu_memory_bytes=parse_bytes(inputs["memory"]),
                          gpus_per_node=inputs["per_node"], gpu_flops=inputs["tflops"] * 1e12,
                          nvlink_bytes_per_s=inputs["nvlink"] * 1e9, infiniband_bytes_per_s=inputs["infiniband"] * 1e9)
    except ValueError as exc:
        st.error(escape_markdown(str(exc)))
        return None
    key, planning = work.planning(config, cluster, inputs["batch"], inputs["checkpoints"], inputs["sizes"],
                                  inputs["pp"], inputs["cp"], inputs["cp_with_pp"])
    return key, planning, f"the plan of {config.model} on {cluster.gpus} GPUs"


def _time(seconds: float) -> str:
    return format_seconds(seconds) if seconds >= 1e-6 or seconds == 0 else "< 1 µs"


def show_plan(config: ModelConfig) -> None:
    """The form, then the last plan's ranked table and its chart of peak per layout against the GPU's memory."""
    st.caption("Every layout of this model on the GPUs below (data-parallel sharding and replicas × tensor × pipeline "
               "× context parallel, checkpointing, microbatch size), each simulated as on the other tabs, ranked: "
               "those that fit first, then the fastest by an estimate. Tensor parallelism stays inside a node.")
    inputs = _inputs(config)
    # queued with everyone's simulations, its progress and Cancel drawn while it runs; kept for this browser tab
    result = asked_result(f"{KEY}.result", _asked(config, inputs) if inputs is not None else None)
    if result is None:
        return
    if result.config != config:
        st.info("This plan is for the model applied before; press Plan the layouts to plan the one applied now.")
    _show_result(result)


def _show_result(result) -> None:
    cluster, planned = result.cluster, result.planned
    fitting = sum(p.fits for p in planned)
    st.markdown(escape_markdown(
        f"{len(planned)} layouts simulated in {format_seconds(result.simulate_s)}, {fitting} fit in "
        f"{format_bytes(cluster.gpu_memory_bytes)} per GPU; {len(result.skipped)} settled or refused without a run "
        "(listed below)."))
    rows = [{
        "Place": i + 1,
        "Layout": p.layout.label(),
        "Peak per GPU": format_bytes(p.peak_bytes),
        "Fits": "yes" if p.fits else "no",
        "Sent per GPU per step": format_bytes(p.collective_bytes_per_step),
        "Step time (estimate)": _time(p.step_time_s),
        "Tokens/s per GPU (estimate)": f"{p.tokens_per_s_per_gpu:,.0f}",
        "Steps accumulated": p.layout.accumulation,
    } for i, p in enumerate(planned)]
    st.table(literal_cells(pd.DataFrame(rows)), hide_index=True)
    st.caption(
        "Peak per GPU: the busiest rank's (pipeline: the busiest stage's), simulated on 3 and 4 layers per stage and "
        "scaled to the model's layers (a stage of 4 layers or fewer is simulated whole). Step time and tokens/s are "
        "estimates, not measurements: each rank's FLOPs at "
        f"{cluster.gpu_flops / 1e12:,.1f} TFLOP/s plus the bytes it sends at {cluster.nvlink_bytes_per_s / 1e9:,.0f} "
        f"GB/s inside a node and {cluster.infiniband_bytes_per_s / 1e9:,.0f} GB/s between nodes, without overlap; "
        "a pipeline runs its 1F1B order.")
    largest = max([p.peak_bytes for p in planned], default=0)
    # The GPU's line where it reads beside the bars; a toy model's KiB against 80 GiB would leave no bar visible.
    with_line = cluster.gpu_memory_bytes <= 2 * largest
    unit, divisor = bytes_unit(max(largest, cluster.gpu_memory_bytes) if with_line else largest)
    frame = pd.DataFrame([{"layout": f"{i + 1}. {p.layout.label()}", unit: p.peak_bytes / divisor,
                           "fits": "fits" if p.fits else "does not fit"} for i, p in enumerate(planned)])
    bars = alt.Chart(frame).mark_bar().encode(
        y=alt.Y("layout:N", sort=None, title=None, axis=alt.Axis(labelLimit=320)),
        x=alt.X(f"{unit}:Q", title=f"peak per GPU ({unit})"),
        color=alt.Color("fits:N", scale=alt.Scale(domain=["fits", "does not fit"], range=["#4c78a8", "#e45756"]),
                        title=None),
        tooltip=["layout", alt.Tooltip(f"{unit}:Q", format=",.2f"), "fits"],
    )
    memory = format_bytes(cluster.gpu_memory_bytes)
    if with_line:
        line = alt.Chart(pd.DataFrame([{unit: cluster.gpu_memory_bytes / divisor, "what": f"GPU memory {memory}"}])
                         ).mark_rule(color="black", strokeDash=[4, 3]).encode(x=f"{unit}:Q", tooltip=["what"])
        chart, title = bars + line, f"Peak per GPU, layout by layout; dashed line: the GPU's {memory}"
    else:
        ratio = cluster.gpu_memory_bytes / max(largest, 1)
        chart = bars
        title = (f"Peak per GPU, layout by layout; the GPU's {memory} is {ratio:,.0f}x the largest peak, off this "
                 "scale")
    show_chart(chart.properties(height=alt.Step(24), title=title))
    if result.skipped:
        with st.expander(f"Settled or refused without a run: {len(result.skipped)}"):
            st.table(literal_cells(pd.DataFrame([{
                "Mesh": " × ".join(f"{MESH_WORDS[k]} {v}" for k, v in s["mesh"].items() if v > 1) or "one GPU",
                "Checkpointing": s["checkpoint"] or "every one",  # None: a degree refused for every layout of it
                "Sequences per microbatch": s["microbatch_size"] or "every size",
                "Why": s["reason"],
            } for s in result.skipped])), hide_index=True)
