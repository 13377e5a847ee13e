"""The sidebar form every page shares: a preset plus every field of ModelConfig, applied on submit."""

from __future__ import annotations

import streamlit as st

from graphviz_core.config import (
    ATTENTIONS,
    CHECKPOINTS,
    DEFAULT_PRESET,
    DEVICES,
    DTYPES,
    LIMITS,
    MODELS,
    PRESETS,
    ModelConfig,
    config_from_preset,
)
from graphviz_core.ui.format import escape_markdown

SIZE_FIELDS = ("hidden", "heads", "layers", "vocab", "batch", "seq")
CHOICE_FIELDS = {"model": MODELS, "attention": ATTENTIONS, "checkpoint": CHECKPOINTS, "device": DEVICES, "dtype": DTYPES}


def _load_preset(key: str) -> None:
    config = config_from_preset(st.session_state[f"{key}.preset"])
    for name, value in config.to_dict().items():
        st.session_state[f"{key}.{name}"] = value


def config_form(key: str = "config") -> ModelConfig | None:
    """Draw the form in the sidebar; return the config last applied (the default preset at first)."""
    if f"{key}.preset" not in st.session_state:
        st.session_state[f"{key}.preset"] = DEFAULT_PRESET
        _load_preset(key)
        st.session_state[f"{key}.applied"] = config_from_preset(DEFAULT_PRESET)
    sidebar = st.sidebar
    sidebar.selectbox(
        "Preset", list(PRESETS), key=f"{key}.preset", on_change=_load_preset, args=(key,),
        help="Loads a preset into the fields below; change any field, then Run.",
    )
    sidebar.caption(PRESETS[st.session_state[f"{key}.preset"]].description)
    with sidebar.form(f"{key}.form"):
        st.selectbox("Model", MODELS, key=f"{key}.model")
        left, right = st.columns(2)
        for i, name in enumerate(SIZE_FIELDS):
            (left if i % 2 == 0 else right).number_input(
                name.capitalize(), min_value=1, max_value=LIMITS[name], step=1, key=f"{key}.{name}"
            )
        st.number_input("Context (gpt2; 0 = seq)", min_value=0, max_value=LIMITS["context"], step=1, key=f"{key}.context")
        st.selectbox("Attention", ATTENTIONS, key=f"{key}.attention", help="sdpa: fused kernel; mha: nn.MultiheadAttention; manual: q@kᵀ, softmax, @v op by op")
        st.selectbox("Checkpointing", CHECKPOINTS, key=f"{key}.checkpoint")
        left, right = st.columns(2)
        left.selectbox("Device", DEVICES, key=f"{key}.device", help="auto: CUDA if available, else CPU; meta: shapes only")
        right.selectbox("Dtype", DTYPES, key=f"{key}.dtype")
        st.number_input("Seed", min_value=0, max_value=2**31 - 1, step=1, key=f"{key}.seed")
        submitted = st.form_submit_button("Run backward pass", type="primary", width="stretch")
    if submitted:
        fields = {name: st.session_state[f"{key}.{name}"] for name in (*SIZE_FIELDS, *CHOICE_FIELDS, "context", "seed")}
        if fields["model"] == "mlp":
            fields["attention"] = "sdpa"  # the MLP has no attention; the field does not apply
            if fields["checkpoint"] == "selective":
                fields["checkpoint"] = "full"
        fields = {k: int(v) if k in (*SIZE_FIELDS, "context", "seed") else v for k, v in fields.items()}
        try:
            st.session_state[f"{key}.applied"] = ModelConfig(**fields, preset=st.session_state[f"{key}.preset"])
            st.session_state.pop(f"{key}.error", None)
        except ValueError as exc:
            st.session_state[f"{key}.error"] = str(exc)
    if f"{key}.error" in st.session_state:
        sidebar.error(escape_markdown(st.session_state[f"{key}.error"]))
    return st.session_state[f"{key}.applied"]
