"""Beyond one GPU: rank 0's memory and the backward's collectives under FSDP, HSDP, DDP, tensor, sequence, pipeline
and context parallelism, and the Plan tab's ranking of layouts."""

import streamlit as st

from graphviz_core.ui.config_form import config_form
from graphviz_core.ui.links import restore_choice
from graphviz_core.ui.navigation import run_through_app
from graphviz_core.ui.parallel_view import (
    get_per_rank,
    is_simulated,
    parallel_form,
    show_collectives,
    show_per_rank,
    show_pipeline,
    show_sequence_split,
)
from graphviz_core.ui.plan_view import show_plan
from graphviz_core.ui.state import dim_stale_results

run_through_app()
st.title("Beyond one GPU")
st.caption(
    "PyTorch's own FSDP2 (and HSDP), DDP, tensor and sequence parallelism, pipeline stages and context parallelism "
    "over a simulated mesh of ranks (torch's fake process group and fake tensors, as torchtitan's memory estimator): "
    "what each rank holds at its peak, and what the backward sends. The Plan tab ranks every layout of the model on "
    "a number of GPUs."
)
st.caption("Pick the layout (strategy, world size, tensor-parallel degree) under Parallelism at the top of the sidebar "
           "and press Simulate ranks; pick the model below it and press Use this model. The page simulates the layout "
           "and the model last applied.")
parallel = parallel_form()  # first in the sidebar: it is what this page is about
config = config_form(submit_label="Use this model")  # it applies the model; "Run backward pass" read as a second run
with dim_stale_results(config is not None and not is_simulated(config, parallel)):  # the last layout's, at once
    result = get_per_rank(config, parallel) if config is not None else None
    if result is not None:
        names = ["Memory per rank", "Communication in backward"] + (["Pipeline stages"] if result.pipeline else [])
        split = ["Context and sequence parallel"] if result.layer_activations is not None else []
        restore_choice("tab", [*names, *split, "Plan"], form_key="parallel", show=True)  # a link's tab, if shown
        tabs = st.tabs([*names, *split, "Plan"], key="tab", bind="query-params")  # the open tab is in the link
        with tabs[-1]:
            show_plan(config)
        with tabs[0]:
            show_per_rank(result)
        with tabs[1]:
            show_collectives(result)
        if result.pipeline:
            with tabs[2]:
                show_pipeline(result)
        if split:
            with tabs[len(names)]:
                show_sequence_split(result)
