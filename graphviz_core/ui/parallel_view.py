"""The "Beyond one GPU" panels: the Parallelism form and rank 0's memory and collectives from graphviz_core.parallel.simulate."""

from __future__ import annotations

import re

import altair as alt
import pandas as pd
import streamlit as st

from graphviz_core.capture.instruments.optimizer import OPTIMIZER_NAMES
from graphviz_core.config import ModelConfig
from graphviz_core.parallel.collectives import GPUS_PER_NODE, INFINIBAND_BYTES_PER_S, NVLINK_BYTES_PER_S
from graphviz_core.parallel.report import PerRank
from graphviz_core.parallel.settings import (
    FSDP_STRATEGIES,
    MAX_WORLD,
    MIXED_PRECISIONS,
    SCHEDULES,
    STRATEGIES,
    ParallelConfig,
    families_declaring,
)
from graphviz_core.serve import work
from graphviz_core.serve.shared_captures import shared_captures
from graphviz_core.ui.capture_cache import get_result
from graphviz_core.ui.charts import show_chart
from graphviz_core.ui.format import bytes_unit, escape_markdown, format_bytes, format_seconds, literal_cells
from graphviz_core.ui.links import (
    coerce,
    dismiss_notices,
    encode,
    note_problems,
    owned_params,
    show_notices,
    write_params,
)

DEFAULT = ParallelConfig("fsdp", 8)
STRATEGY_LABELS = {
    "none": "one device (no parallelism)",
    "ddp": "DDP (replicate, all-reduce gradients)",
    "fsdp": "FSDP (shard every layer)",
    "hsdp": "HSDP (shard in groups, replicate across)",
    "tp": "tensor parallel",
    "fsdp+tp": "FSDP x tensor parallel (2-D mesh)",
}
# In the sidebar's narrow box (the long labels above were cut: "FSDP (shard every lay"); the help spells them out
STRATEGY_SHORT = {"none": "one device", "ddp": "DDP", "fsdp": "FSDP", "hsdp": "HSDP", "tp": "tensor parallel",
                  "fsdp+tp": "FSDP × TP (2-D)"}
# The number fields: label and allowed range. The widgets take any whole number (with min/max set, Streamlit kept the
# last value in range without a word, and the button simulated that one); the submit checks the range and says so.
NUMBER_FIELDS = {
    "world_size": ("World size (GPUs)", 1, MAX_WORLD),
    "tp": ("TP degree", 1, MAX_WORLD),
    "shard_group": ("HSDP shard group (ranks)", 0, MAX_WORLD),
    "pp": ("Pipeline stages (pp)", 1, MAX_WORLD),
    "microbatches": ("Microbatches", 1, 4096),
    "stages_per_rank": ("Stages per rank", 1, 64),
    "cp": ("Context parallel (cp)", 1, MAX_WORLD),
}
PART_LABELS = {
    "parameters": "parameters held by this rank",
    "gathered_parameters": "all-gathered parameters (live during compute)",
    "gradients": "gradients held by this rank",
    "unsharded_gradients": "unsharded gradients (before reduce-scatter)",
    "optimizer": "optimizer state ({optimizer}; in the step, with its temporaries)",
    "activations": "activations (saved for backward) and inputs",
    "temporaries": "temporaries (backward's gradients of activations)",
    "communication_buffers": "all-gather and reduce-scatter buffers",
}
KIND_LABELS = {
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
    "all_to_all": "all-to-all",
    "broadcast": "broadcast",
    "send": "send (pipeline)",
    "recv": "receive (pipeline)",
}


def parse_layout(params: dict[str, str]) -> tuple[ParallelConfig | None, list[str]]:
    """The layout a link names (`?strategy=tp&world_size=2&tp=2`; fields it leaves out are the page's default's),
    None when it names none or one that cannot be used, and what was wrong with it."""
    given = {name: params[name] for name in DEFAULT.to_dict() if name in params}
    if not given:
        return None, []
    fields, problems = DEFAULT.to_dict(), []
    for name, raw in given.items():
        value, problem = coerce(name, raw, type(fields[name]))
        if problem:
            problems.append(problem)
        else:
            fields[name] = value
    if problems:
        return None, problems
    try:
        return ParallelConfig(**fields), []
    except ValueError as exc:
        return None, [str(exc)]


def layout_params(parallel: ParallelConfig) -> dict[str, str]:
    """The fields of `parallel` that differ from the page's default, as URL parameters."""
    default = DEFAULT.to_dict()
    return {
        name: encode(value)
        for name, value in parallel.to_dict().items()
        if value != default[name]
    }


def out_of_range(fields: dict) -> list[str]:
    """A sentence for each number field outside its range, naming it by its label."""
    return [f"{label} must be a whole number from {low:,} to {high:,} (got {fields[name]:,})."
            for name, (label, low, high) in NUMBER_FIELDS.items() if not low <= fields[name] <= high]


def in_user_words(message: str) -> str:
    """The core's sentence (written for the CLI: `strategy 'tp'`, `pick strategy fsdp, ddp or fsdp+tp`) with the
    strategies named as the Strategy box shows them."""
    names = "|".join(re.escape(s) for s in sorted(STRATEGIES, key=len, reverse=True))
    message = re.sub(rf"'({names})'", lambda m: f'"{STRATEGY_SHORT[m.group(1)]}"', message)
    # an unquoted list right after "strategy": "strategy fsdp, ddp or fsdp+tp", "strategy tp or fsdp+tp"
    return re.sub(rf"(?<=strategy )((?:{names})(?:(?:, | or )(?:{names}))*)(?![\w+])",
                  lambda m: re.sub(rf"(?<![\w+])({names})(?![\w+])", lambda n: f'"{STRATEGY_SHORT[n.group(1)]}"',
                                   m.group(1)), message)


def _load(key: str, parallel: ParallelConfig) -> None:
    st.session_state[f"{key}.applied"] = parallel
    for name, value in parallel.to_dict().items():
        st.session_state[f"{key}.{name}"] = value


def _sync_url(parallel: ParallelConfig) -> None:
    write_params(DEFAULT.to_dict(), layout_params(parallel))


def parallel_form(key: str = "parallel") -> ParallelConfig:
    """The "Parallelism" form at the top of the sidebar; returns the layout last applied (FSDP over 8 at first).
    A link's layout is read once per session; a refused layout or link is said at the top of the main area too."""
    if f"{key}.applied" not in st.session_state:
        params, unreadable = owned_params(DEFAULT.to_dict())  # given twice, or too long: the default, with a notice
        linked, problems = parse_layout(params) if not unreadable else (None, [])
        _load(key, linked or DEFAULT)
        note_problems(key, unreadable + problems, "layout")
    st.sidebar.markdown("**Parallelism**")
    with st.sidebar.form(f"{key}.form"):
        st.selectbox("Strategy", STRATEGIES, format_func=STRATEGY_SHORT.get, key=f"{key}.strategy",
                     help="; ".join(STRATEGY_LABELS[s] if STRATEGY_LABELS[s].startswith(STRATEGY_SHORT[s])
                                    else f"{STRATEGY_SHORT[s]}: {STRATEGY_LABELS[s]}" for s in STRATEGIES))
        left, right = st.columns(2)
        left.number_input("World size (GPUs)", step=1, key=f"{key}.world_size")
        right.number_input(
            "TP degree",
            step=1,
            key=f"{key}.tp",
            help="Ranks that split each layer's matmuls (tensor parallel: = world size; FSDP x TP: divides it).",
        )
        st.number_input(
            "HSDP shard group (ranks)",
            step=1,
            key=f"{key}.shard_group",
            help="HSDP only: ranks that shard one copy of the model, typically one node's 8 GPUs; 0 otherwise.",
        )
        st.checkbox(
            "Reshard after forward (FSDP)",
            key=f"{key}.reshard_after_forward",
            help="Free each layer's gathered parameters after its forward and gather them again in backward. The "
            "root (embeddings, final norm, head) stays gathered either way, FSDP2's default for it.",
        )
        st.selectbox(
            "Mixed precision (FSDP2 policy)",
            MIXED_PRECISIONS,
            key=f"{key}.mixed_precision",
            help="bf16: float32 master shards, bfloat16 compute and gradient reduction; bf16-fp32-reduce reduces "
            "gradients in float32. Needs dtype float32.",
        )
        _pipeline_fields(key)
        _sequence_fields(key)
        submitted = st.form_submit_button(
            "Simulate ranks",
            width="stretch",
            help="Applies this layout; the model below is applied by its own button, Use this model.",
        )
    if submitted:
        dismiss_notices(key)
        fields = {name: st.session_state[f"{key}.{name}"] for name in DEFAULT.to_dict()}
        for name in ("world_size", "tp", "shard_group", "pp", "microbatches", "stages_per_rank", "cp"):
            fields[name] = int(fields[name])
        fields["sequence_parallel"] = bool(fields["sequence_parallel"])
        try:
            if problems := out_of_range(fields):
                raise ValueError(" ".join(problems))
            st.session_state[f"{key}.applied"] = ParallelConfig(**fields)
            st.session_state.pop(f"{key}.error", None)
        except ValueError as exc:
            st.session_state[f"{key}.error"] = in_user_words(str(exc))
            # the result on screen stays, and only this refusal is said: a layout refused before (by the model) is
            # not tried again behind it
            if (shown := st.session_state.get(f"{key}.shown")) is not None:
                st.session_state[f"{key}.applied"] = shown.parallel
    if f"{key}.error" in st.session_state:
        st.sidebar.error(escape_markdown(st.session_state[f"{key}.error"]))
        # and at the top of the main area: the button is below the fold and the result there would read as new
        st.error(escape_markdown(f"Not run: {st.session_state[f'{key}.error']}{still_shown(key)}"))
    show_notices(key)
    return st.session_state[f"{key}.applied"]


def layout_words(parallel: ParallelConfig) -> str:
    """A layout as the page names it: "FSDP over 8 ranks", "FSDP over 8 ranks, 2 pipeline stages"."""
    extras = [f"{parallel.pp} pipeline stages"] if parallel.pp > 1 else []
    extras += [f"context parallel {parallel.cp}"] if parallel.cp > 1 else []
    extras += ["sequence parallel"] if parallel.sequence_parallel else []
    return ", ".join([f"{STRATEGY_SHORT[parallel.strategy]} over {parallel.world_size} ranks", *extras])


def still_shown(key: str) -> str:
    """The sentence after a refusal naming the result really on screen (the last one simulated in this tab), or ""
    before any."""
    shown = st.session_state.get(f"{key}.shown")
    if shown is None:
        return ""
    model = f"{shown.config.model}, " if shown.config is not None else ""
    return f" The result shown is still that of the last layout run ({model}{layout_words(shown.parallel)})."


def _taking(declares) -> str:
    """The offered families whose parallel plan `declares` a layout, as words (settings.families_declaring)."""
    names = families_declaring(declares)
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


def _pipeline_fields(key: str) -> None:
    """Pipeline parallelism's four fields, inside the Parallelism form."""
    left, right = st.columns(2)
    left.number_input("Pipeline stages (pp)", step=1, key=f"{key}.pp",
                      help="Pipeline-parallel ranks: the layers are split into stages, one group of ranks each; the "
                      "world size counts them (FSDP 8 x pp 4 = 32). 1: no pipeline. Takes a decoder whose family declares its "
                      f"stages (model family {_taking(lambda p: p.stages)}); a head tied to the embedding is copied "
                      "to the last stage and its gradient summed with the first stage's.")
    right.number_input("Microbatches", step=1, key=f"{key}.microbatches",
                       help="Pipeline: the batch (per data-parallel rank) is split into this many; it must divide "
                       "the batch. 1F1B needs at least pp.")
    left, right = st.columns(2)
    left.selectbox("Schedule", SCHEDULES, key=f"{key}.schedule",
                   help="gpipe: every forward, then every backward; 1f1b: one forward, one backward once the pipeline "
                   "is full; interleaved-1f1b: several stages per rank.")
    right.number_input("Stages per rank", step=1, key=f"{key}.stages_per_rank",
                       help="interleaved-1f1b only: stages each pipeline rank holds (looped: rank r has r, r + pp, …).")


def _sequence_fields(key: str) -> None:
    """Context parallel's degree and sequence parallel's switch, inside the Parallelism form."""
    # one per row: beside the number box the checkbox's label was cut at 1280 px ("Sequ…")
    st.number_input("Context parallel (cp)", step=1, key=f"{key}.cp",
                    help="Ranks that each hold 1/cp of every sequence; attention runs as torch's ring, passing keys "
                    "and values between them. With DDP, FSDP or FSDP x TP, with or without pipeline stages; the world "
                    "size counts them (pp x data x cp x TP). 1: off. Takes a decoder whose attention runs as the ring "
                    f"(model family {_taking(lambda p: p.ring_attention)}).")
    st.checkbox("Sequence parallel (with TP)", key=f"{key}.sequence_parallel",
                   help="With tensor parallel: norms run on 1/TP of the tokens; the attention and MLP gather the "
                   "whole sequence before their projections and scatter it after (Megatron sequence parallel). With "
                   "pipeline stages, each passes its 1/TP of the tokens to the next. Takes model family "
                   f"{_taking(lambda p: p.sequence)}.")


def is_simulated(config: ModelConfig, parallel: ParallelConfig) -> bool:
    """Whether `config` laid out as `parallel` is simulated already (get_per_rank then returns at once)."""
    return shared_captures().lookup_key(work.simulation(config, parallel)[0]) is not None


def get_per_rank(config: ModelConfig, parallel: ParallelConfig, key: str = "parallel") -> PerRank | None:
    """The simulation of `config` laid out as `parallel`, shared by every session (queued with everyone's work, with
    a Cancel button while it runs; graphviz_core.serve.work). When it cannot run, or was cancelled: an st.error or
    the cancelled notice, and the result the page showed last in this browser tab (None before any)."""
    wanted, simulate = work.simulation(config, parallel)
    try:
        result = get_result(wanted, simulate, f"the simulation of {STRATEGY_LABELS[parallel.strategy]} over "
                                              f"{parallel.world_size} ranks")
    except ValueError as exc:
        result = None
        st.error(escape_markdown(f"Not run: {in_user_words(str(exc))}{still_shown(key)}"))
    if result is None:
        shown = st.session_state.get(f"{key}.shown")
        if shown is not None:  # the link names what is on screen, not the layout refused
            _sync_url(shown.parallel)
        return shown
    st.session_state[f"{key}.shown"] = result
    _sync_url(result.parallel)
    return result


def show_per_rank(result: PerRank) -> None:
    """Rank 0's figures next to one device and the closed form, the peak per phase, the timeline."""
    parallel = result.parallel
    # a flattened dimension (dp_cp: data and context ranks, over which FSDP shards) repeats others: left out here
    mesh = " x ".join(f"{name} {size}" for name, size in result.mesh.items() if "_" not in name) or "one device"
    shown = ("Rank 0 shown: it holds the first pipeline stage; the stages differ (embedding first, head last), "
             "each is under Pipeline stages." if result.pipeline else
             "Rank 0 shown: every rank runs the same program on equal parts, so the ranks are symmetric.")
    cast = (f" Forward and loss under torch.autocast({result.autocast}) on every rank, the weights in "
            f"{result.config.dtype if result.config is not None else 'their dtype'}." if result.autocast != "none" else "")
    st.caption(
        f"{STRATEGY_LABELS[parallel.strategy]} over {parallel.world_size} ranks (mesh: {mesh}). {shown} One "
        f"{OPTIMIZER_NAMES[result.optimizer]} step in steady state (optimizer state already allocated).{cast} "
        f"Simulated in {format_seconds(result.simulate_s)}."
    )
    for note in result.notes:
        st.caption(escape_markdown(note))
    if parallel.strategy in FSDP_STRATEGIES and (reshard := result.reshard_summary()):
        layers = "reshard after forward" if reshard["layers"] is True else "stay gathered after forward"
        st.caption(
            f"FSDP as training scripts wrap it (torchtitan): the layers {layers}; the root (embeddings, final norm, "
            "head) stays gathered after forward, FSDP2's default for it, so backward does not gather it again."
        )
    if note := finetune_note(result.config):
        st.caption(note)
    alone = result.single_device
    cols = st.columns(4)
    for col, label, value, single in (
        (cols[0], "Parameters per rank", result.parameter_bytes, alone and alone.parameter_bytes),
        (cols[1], "Gradients per rank", result.gradient_bytes, alone and alone.gradient_bytes),
        (cols[2], "Optimizer state per rank", result.optimizer_bytes, alone and alone.optimizer_bytes),
        (cols[3], "Peak memory per rank", result.peak_bytes, alone and alone.peak_bytes),
    ):
        col.metric(label, format_bytes(value), help=f"One device: {format_bytes(single)}" if alone else None)

    st.subheader("Rank 0 next to one device and the closed form")
    expected = result.expected
    closed = (None, None, None) if result.pipeline else (
        expected.parameter_bytes, expected.gradient_bytes, expected.optimizer_bytes)
    rows = [
        ("Parameters", result.parameter_bytes, closed[0], alone and alone.parameter_bytes),
        ("Gradients", result.gradient_bytes, closed[1], alone and alone.gradient_bytes),
        ("Optimizer state", result.optimizer_bytes, closed[2], alone and alone.optimizer_bytes),
        ("Peak of the step", result.peak_bytes, None, alone and alone.peak_bytes),
    ]
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "": name,
                    "Rank 0 (as torch laid it out)": format_bytes(measured),
                    "Closed form": format_bytes(closed) if closed is not None else "—",
                    "Rank 0 minus closed form": format_bytes(measured - closed) if closed is not None else "—",
                    "One device": format_bytes(single) if alone else "—",  # SGD's state on one device: 0 B
                }
                for name, measured, closed, single in rows
            ]
        ),
        hide_index=True,
        width="stretch",
    )
    padding = (" FSDP2 pads each parameter's first dimension to a multiple of its ranks."
               if parallel.strategy in FSDP_STRATEGIES else "")
    if not result.pipeline:  # a pipeline's closed form is per stage: the column above is empty
        st.caption(f"Closed form: {expected.formula}.{padding}")
    st.caption("As in every memory figure of this app, the peaks count the batch (input ids and targets) with the "
               "activations and leave the module buffers out"
               + (f": {format_bytes(result.buffer_bytes)} of them (rotary tables, BatchNorm statistics) on every rank, "
                  "whole." if result.buffer_bytes else "; this model has none."))

    _show_phases(result)


def _show_phases(result: PerRank) -> None:
    """What is live at each phase's peak, the sentence naming the gap, and the timeline of bytes live."""
    st.subheader("What is live at each phase's peak")
    phase_rows = []
    for part, label in PART_LABELS.items():
        label = label.format(optimizer=OPTIMIZER_NAMES[result.optimizer])
        values = {p.phase: p.parts_bytes[part] for p in result.phases}
        if any(values.values()):
            phase_rows.append({"": label, **{phase.capitalize(): format_bytes(v) for phase, v in values.items()}})
    phase_rows.append({"": "peak", **{p.phase.capitalize(): format_bytes(p.peak_bytes) for p in result.phases}})
    st.dataframe(pd.DataFrame(phase_rows), hide_index=True, width="stretch")
    peak_phase = max(result.phases, key=lambda p: p.peak_bytes)
    persistent = result.parameter_bytes + result.optimizer_bytes
    gap = {PART_LABELS[k].format(optimizer=OPTIMIZER_NAMES[result.optimizer]): v for k, v in peak_phase.parts_bytes.items() if k not in ("parameters", "optimizer") and v}
    st.markdown(
        f"The step peaks in **{peak_phase.phase}** at {format_bytes(peak_phase.peak_bytes)}: "
        f"{format_bytes(persistent)} of this rank's parameters and optimizer state, which live all step, plus "
        + ", ".join(f"{name} {format_bytes(v)}" for name, v in sorted(gap.items(), key=lambda kv: -kv[1]))
        + "."
    )
    # the axis in the unit its largest value reads best in, as the tables above (Llama 3.1 8B ran to "60,000 MiB")
    unit, divisor = bytes_unit(max((value for _, value in result.timeline), default=0))
    timeline = pd.DataFrame(
        [{"step": i, "phase": phase, unit: value / divisor} for i, (phase, value) in enumerate(result.timeline)]
    )
    if not timeline.empty:
        show_chart(
            alt.Chart(timeline)
            .mark_line()
            .encode(
                x=alt.X("step:Q", title="ops, in order (sampled)"),
                y=alt.Y(f"{unit}:Q", title=f"{unit} live on rank 0"),
                color=alt.Color("phase:N", sort=["forward", "backward", "optimizer"]),
                tooltip=[alt.Tooltip("phase:N"), alt.Tooltip(f"{unit}:Q", title=f"{unit} live on rank 0",
                                                             format=",.3f")],
            )
            .properties(height=220),
        )


def finetune_note(config: ModelConfig | None) -> str | None:
    """What LoRA or frozen parameters change in the figures (escaped: the names are the user's); None for full
    fine-tuning."""
    if config is None or (config.finetune == "full" and not config.freeze):
        return None
    trained = []
    if config.finetune == "lora":
        targets = ", ".join(name for name in config.lora_targets.split(",") if name) or ", ".join(
            config.family.default_lora_targets(config))
        trained.append(f"LoRA adapters of rank {config.lora_rank} on {targets} train, every base weight frozen")
    if config.freeze:
        trained.append(f"parameters matching {config.freeze} are frozen")
    return escape_markdown(
        "Fine-tuning: " + "; ".join(trained) + ". Frozen weights are sharded (FSDP), split (tensor parallel) or "
        "copied (DDP) like the rest but get no gradient, no optimizer state and no share of the backward's "
        "reduce-scatter or all-reduce: the gradients and optimizer state below are the trained parameters' only."
    )


def show_collectives(result: PerRank) -> None:
    """The backward's collectives: kind, size, which module triggered them, and the time at the stated links."""
    backward = [c for c in result.collectives if c.phase == "backward"]
    cols = st.columns(3)
    cols[0].metric("Sent per rank per step", format_bytes(result.collective_bytes()))
    cols[1].metric("Of which in backward", format_bytes(result.collective_bytes("backward")))
    cols[2].metric("Backward communication time", _time(result.collective_time_s("backward")))
    st.caption(
        f"Times at NVLink {NVLINK_BYTES_PER_S / 1e9:.0f} GB/s per direction inside a node of {GPUS_PER_NODE} GPUs "
        f"and InfiniBand {INFINIBAND_BYTES_PER_S / 1e9:.0f} GB/s per GPU (400 Gb/s NDR) across nodes; ring "
        "algorithm volumes, no latency, no overlap with compute."
    )
    graph_nodes = sum(result.backward_nodes_by_category.values())
    communication_nodes = result.backward_nodes_by_category.get("communication", 0)
    strategy = result.parallel.strategy
    where = []
    if result.parallel.tp > 1:
        where.append("tensor parallelism's DTensor conversions; those whose backward sends data are listed below "
                     "with their node")
    hooks = {"fsdp": "FSDP's", "hsdp": "HSDP's", "fsdp+tp": "FSDP's",
             "ddp": "DDP's (torch's replicate, built on FSDP2's hooks)"}.get(strategy)
    hook_word = " (replicate hook)" if strategy == "ddp" else " (FSDP hook)"
    if result.pipeline is not None:
        stages = [s.stage for s in result.pipeline.per_stage if s.rank == 0]
        whose = (f"Rank 0's backward graph for one microbatch (stage{'s' * (len(stages) > 1)} "
                 f"{', '.join(map(str, stages))}; each microbatch's is alike)")
        sends = (" The sends and receives between stages are issued by torch's PipelineStage outside the graph, "
                 "between one microbatch's forward or backward and the next.")
    else:
        whose, sends = "Rank 0's backward graph", ""
    st.caption(
        f"{whose} has {graph_nodes:,} autograd nodes, {communication_nodes:,} of them in the "
        f"communication category{' (' + where[0] + ')' if where else ''}.{sends}"
        + (f" {hooks} collectives run in hooks, outside the graph: the table names the module whose hook issued "
           "each one." if hooks else "")
    )
    if not result.collectives:
        st.info("This layout issues no collectives: nothing is shared between ranks.")
        return
    for title, rows, expanded in (
        (f"Backward: {len(backward)} collectives", backward, True),
        (
            f"Forward and optimizer step: {len(result.collectives) - len(backward)} collectives",
            [c for c in result.collectives if c.phase != "backward"],
            False,
        ),
    ):
        with st.expander(title, expanded=expanded):
            # st.table wraps: nine columns, where a data grid at 1280 px ran past its right edge (Group and Time). The
            # number is the row's header (the page's tables let their first two cells break inside a word, made for
            # module paths: as a cell, "10" read "1" over "0"); the module that triggered it comes first.
            table = pd.DataFrame(
                [
                    {
                        "Triggered by": (c.module or "(top level)") + (hook_word if c.issued_by == "hook" else ""),
                        "Collective": KIND_LABELS[c.kind],
                        "Buffer": format_bytes(c.buffer_bytes),
                        "Sent by this rank": format_bytes(c.traffic_bytes),
                        "Parameters of": "—" if c.parameters_of is None else (c.parameters_of or "(top level)"),
                        "Autograd node (communication)": c.autograd_node or "—",
                        "Group": f"{c.group} ({c.group_size} ranks, {c.link})",
                        "Time": _time(c.time_s),
                    }
                    for c in rows
                ],
                index=pd.Index([i + 1 for i in range(len(rows))], name="#"),
            )
            st.table(literal_cells(table))


def _time(seconds: float) -> str:
    # Toy models move a few KiB: well under a microsecond at these bandwidths, which "0 µs" would misstate.
    return format_seconds(seconds) if seconds >= 1e-6 or seconds == 0 else "< 1 µs"


def show_pipeline(result: PerRank) -> None:
    """Every stage of the pipeline: its layers, what it holds, how many microbatches at most, what it sends."""
    pipeline = result.pipeline
    stages = pipeline.per_stage
    cols = st.columns(3)
    busiest = max(stages, key=lambda s: s.peak_bytes)
    cols[0].metric("Peak of the busiest stage", format_bytes(busiest.peak_bytes), help=f"stage {busiest.stage}")
    cols[1].metric("Bubble", f"{pipeline.bubble_fraction:.1%}",
                   help="Idle share of the pipeline ranks' time: each runs the schedule's actions in order, each as "
                   "soon as its input has arrived, a forward or backward taking time in proportion to its measured "
                   "FLOPs (transfers not timed).")
    cols[2].metric("Sent between stages per step", format_bytes(pipeline.send_bytes))
    st.caption(
        f"{pipeline.schedule} over {pipeline.pp} pipeline ranks, {len(stages)} stages, {pipeline.microbatches} "
        f"microbatches of {pipeline.microbatch_size}. Each rank's stages really ran, one rank after the other, over "
        "the fake process group; microbatches in flight are counted from the actions each rank ran, in order."
    )
    # st.table wraps its headers and cells: eleven columns as a data grid were cut at 1280 px. The stage is the row's
    # header and the rank the first cell: the page's tables let their first two cells break inside a word (made for
    # module paths), which broke "embedding" in the layers' cells.
    table = pd.DataFrame(
        [
            {
                "Rank": s.rank,
                "Layers": f"{s.layers[0]}–{s.layers[1] - 1}" + (" + embedding" if s.embedding else "")
                + (" + head" if s.head else ""),
                "Parameters": format_bytes(s.parameter_bytes),
                "Gradients": format_bytes(s.gradient_bytes),
                "Optimizer state": format_bytes(s.optimizer_bytes),
                "Activations per microbatch": format_bytes(s.activation_bytes_per_microbatch),
                "Microbatches in flight at peak": s.microbatches_in_flight_at_peak,
                "Peak of its rank": format_bytes(s.peak_bytes),
                "Sent": format_bytes(s.send_bytes),
                "Received": format_bytes(s.recv_bytes),
            }
            for s in stages
        ],
        index=pd.Index([s.stage for s in stages], name="Stage"),
    )
    st.table(literal_cells(table))
    # the axis in the unit its largest value reads best in (a toy's MiB read "GiB 0.0000-0.0040")
    unit, divisor = bytes_unit(max(s.peak_bytes for s in stages))
    chart = pd.DataFrame([{"stage": str(s.stage), unit: s.peak_bytes / divisor} for s in stages])
    show_chart(
        alt.Chart(chart).mark_bar().encode(
            x=alt.X("stage:N", title="stage", sort=None),
            y=alt.Y(f"{unit}:Q", title=f"peak of the stage's rank ({unit})"),
        ).properties(height=200)
    )
    with st.expander("The schedule's order of actions, rank by rank"):
        st.caption("`2F5`: stage 2 runs microbatch 5's forward; `B`: its backward (microbatches count from 0). In "
                   "the order each rank's runtime ran them.")
        if pipeline.order_note:
            st.caption(pipeline.order_note)
        st.dataframe(
            pd.DataFrame([{"Rank": rank, "Actions": " ".join(actions)} for rank, actions in pipeline.order.items()]),
            hide_index=True,
            width="stretch",
        )


PART_NAMES = {
    "norms": "norms (RMSNorm)",
    "attention": "attention (q, k, v, output, log-sum-exp)",
    "mlp": "MLP (SwiGLU)",
    "gathered_inputs": "all-gathered inputs of the projections",
    "ring_output_copy": "copy of the ring's attention output",
}


def show_sequence_split(result: PerRank) -> None:
    """Context / sequence parallel: one layer's activations on rank 0 (measured, counted, Korthikanti et al.'s
    formula) and the ring's key/value traffic."""
    layer, parallel = result.layer_activations, result.parallel
    count = sum(layer.count_bytes.values())
    cols = st.columns(3)
    cols[0].metric("One layer's activations on rank 0", format_bytes(layer.measured_bytes),
                   help="Kept for backward, measured: the same layout on a 2-layer and a 1-layer copy of the model, "
                   "activations alive when forward ends, subtracted.")
    cols[1].metric("Counted by hand", format_bytes(count))
    korthikanti = sum(layer.korthikanti_bytes.values()) if layer.korthikanti_bytes else None
    cols[2].metric("Korthikanti et al. (16-bit)", format_bytes(korthikanti) if korthikanti else "—",
                   help=layer.korthikanti_formula or "Their formula covers tensor and sequence parallel only.")
    split = []
    if parallel.cp > 1 and result.config is not None:
        split.append(f"context parallel {parallel.cp}: each rank holds {result.config.seq // parallel.cp} of the "
                     f"{result.config.seq} tokens of every sequence")
    if parallel.sequence_parallel:
        split.append(f"sequence parallel: the norms run on 1/{parallel.tp} of the tokens")
    if split:
        st.caption("; ".join(split).capitalize() + ". Activations in the model's dtype, statistics in float32.")
    if result.pipeline is not None:
        size = result.pipeline.microbatch_size
        st.caption(f"With the pipeline: one layer of a stage, per microbatch ({size} sequence{'s' * (size != 1)}; "
                   "one stage's ranks simulated without the pipeline, on 2- and 1-layer copies); a stage "
                   "keeps this for every microbatch in flight, as counted under Pipeline stages. The keys and values "
                   "below are per layer and microbatch.")
    published = layer.korthikanti_bytes or {}
    rows = [
        {"Part": PART_NAMES[part], "Counted (this model, this rank)": format_bytes(value)}
        | ({"Korthikanti et al. (as published)": format_bytes(published[part]) if part in published else "—"}
           if published else {})
        for part, value in layer.count_bytes.items()
        if value or part in published
    ]
    rows.append({"Part": "one layer", "Counted (this model, this rank)": format_bytes(count)}
                | ({"Korthikanti et al. (as published)": format_bytes(korthikanti)} if published else {}))
    st.table(literal_cells(pd.DataFrame(rows)), hide_index=True)
    if layer.korthikanti_formula:
        st.caption(f"Korthikanti et al., \"Reducing Activation Recomputation in Large Transformer Models\": "
                   f"{layer.korthikanti_formula}. Why this model differs:")
        for note in layer.differences:
            st.markdown(f"- {escape_markdown(note)}")
    if exchange := layer.kv_exchange:
        st.subheader("Keys and values passed between context ranks, per layer")
        st.table(literal_cells(pd.DataFrame([
            {"": "forward", "Sent by this rank (recorded)": format_bytes(exchange["recorded_forward_bytes"]),
             "By formula": format_bytes(exchange["formula_forward_bytes"])},
            {"": "backward", "Sent by this rank (recorded)": format_bytes(exchange["recorded_backward_bytes"]),
             "By formula": format_bytes(exchange["formula_backward_bytes"])},
        ])), hide_index=True)
        st.caption(f"{exchange['collectives_per_layer']} collectives per layer. Formula: {exchange['formula']}.")
