"""The sidebar form every page shares: a preset, the model family, and every field that family has, applied on Run."""

from __future__ import annotations

import dataclasses
import functools
import re

import streamlit as st
import torch

from graphviz_core.capture.device import check_budget, resolve_device
from graphviz_core.capture.instruments.optimizer import OPTIMIZER_NAMES
from graphviz_core.config import (
    AUTOCASTS,
    CHECKPOINTS,
    CUSTOM,
    DEFAULT_PRESET,
    DEVICES,
    DTYPES,
    FAMILIES,
    FINETUNES,
    LORA_ALPHA,
    LORA_FIELDS,
    LORA_RANK,
    MODEL_DEFAULTS,
    MODELS,
    OPTIMIZERS,
    PRESETS,
    SEED_MAX,
    ModelConfig,
    applies,
    config_from_preset,
)
from graphviz_core.fields import FIELDS, SIZE, SIZES, in_form
from graphviz_core.models.family import FIELD_HELP, FIELD_LABELS, FIELD_ZERO
from graphviz_core.models.model_files import trusted_factories
from graphviz_core.ui.format import escape_markdown
from graphviz_core.ui.links import copy_link, dismiss_notices, restore_from_link, show_notices, sync_url
from graphviz_core.ui.state import keep_widget_state

# Every field from its declaration (graphviz_core.fields): the size inputs, in the order declared there.
SIZE_FIELDS = in_form(SIZES)
FINETUNE_FIELDS = ("finetune", *LORA_FIELDS, "freeze")  # the Fine-tuning box (outside the form) and its fields
FINETUNE_LABELS = {"full": "full (every weight trains)", "lora": "LoRA (base weights frozen)"}
AUTOCAST_LABELS = {"none": "none", "bfloat16": "bfloat16",
                   "float16": "float16 + scaler"}  # short: the sidebar shows the value whole


# Each attention kernel in a sentence; the help names only those the family offers
ATTENTION_HELP = {"sdpa": "one fused kernel", "eager": "transformers' op-by-op reference (scores kept)",
                  "mha": "nn.MultiheadAttention", "manual": "q@kᵀ, softmax, @v op by op"}


def _label(name: str, model: str) -> str:
    return FAMILIES[model].label(name)


# The core's sentences name the CLI's flags (--freeze) and the config's fields (lora_rank), as the CLI reads them; the
# form says its own labels instead ("Freeze parameters (glob)"). Fields whose names are plain words (heads, layers,
# context) are left as they are: sentences use those words as words.
_FIELD_NAMES = ("hidden", "seq", "vocab", "kv_heads", "intermediate", "experts_per_token", "image_size", "lora_rank",
                "lora_alpha", "lora_targets", "finetune")


def in_form_words(sentence: str, model: str) -> str:
    """`sentence` with CLI flags and config field names replaced by the form's labels, in quotes."""
    def label(name: str) -> str:
        return f"“{(FAMILIES[model] if model in FAMILIES else FAMILIES['gpt2']).label(name)}”"

    sentence = re.sub(r" \(--[a-z-]+\)", "", sentence)  # "lora_targets (--lora-targets)": the label once
    sentence = sentence.replace("no --compile", "“torch.compile” unticked")
    sentence = re.sub(r"--([a-z-]+) none", r"--\1 set to none", sentence)
    sentence = re.sub(r"--([a-z_-]+)", lambda m: label(m[1].replace("-", "_")) if m[1].replace("-", "_") in
                      FIELD_LABELS else m[0], sentence)
    names = "|".join(_FIELD_NAMES)
    return re.sub(rf"(?<![\w'“-])({names})(?![\w'”-]| size)", lambda m: label(m[1]), sentence)


def _attentions(model: str) -> tuple[str, ...]:
    return FAMILIES[model].attentions


def _devices() -> tuple[str, ...]:
    # Offer cuda only where this machine has it (a choice that can only fail is no choice).
    return DEVICES if torch.cuda.is_available() else tuple(d for d in DEVICES if d != "cuda")


def _load(key: str, config: ModelConfig) -> None:
    for name, value in config.to_dict().items():
        if name == "preset":
            continue
        st.session_state[f"{key}.{name}"] = value
    if config.device not in _devices():
        st.session_state[f"{key}.device"] = "auto"


# The preset box's entry while the config on screen is none of the presets (a field was changed, a link names the config
# by its fields): the box never names a preset the result was not made from. Listed only while it is the box's value.
NOT_A_PRESET = "(custom: the fields below)"


@functools.cache
def _preset_configs() -> dict[str, ModelConfig]:
    return {name: config_from_preset(name).replace(preset="") for name in PRESETS}


def preset_of(config: ModelConfig) -> str:
    """The preset whose every field `config` has (its own name first), else NOT_A_PRESET."""
    if config.family.user_code:
        return NOT_A_PRESET
    bare, presets = config.replace(preset=""), _preset_configs()
    if presets.get(config.preset) == bare:
        return config.preset
    return next((name for name, fields in presets.items() if fields == bare), NOT_A_PRESET)


def _named(config: ModelConfig) -> ModelConfig:
    """`config` named after the preset it is exactly (so its link is `?preset=…`), or by its fields alone."""
    preset = preset_of(config)
    return config.replace(preset="" if preset == NOT_A_PRESET else preset)


def _load_preset(key: str) -> None:
    if st.session_state[f"{key}.preset"] == NOT_A_PRESET:  # nothing to load: the box only says what the fields are
        return
    _load(key, config_from_preset(st.session_state[f"{key}.preset"]))


def _load_family(key: str) -> None:
    """Switching family starts from that family's toy-size defaults: its fields differ from the last one's."""
    model = st.session_state[f"{key}.model"]
    _load(key, ModelConfig(**MODEL_DEFAULTS[model]))
    tiny = f"{model}-tiny"
    st.session_state[f"{key}.preset"] = (
        tiny
        if tiny in PRESETS
        else next(
            (n for n, p in PRESETS.items() if p.fields == MODEL_DEFAULTS[model]), st.session_state[f"{key}.preset"]
        )
    )


def form_fields(key: str) -> dict:
    """The config fields as the form holds them now; fields the family does not have take their neutral value."""
    model = st.session_state[f"{key}.model"]
    fields = {}
    for name in FIELDS:
        value = st.session_state.get(f"{key}.{name}", getattr(ModelConfig, name))
        if name in ("kv_heads", "intermediate", "experts", "experts_per_token", "image_size", "context", "tied"):
            value = value if applies(name, model) else getattr(ModelConfig, name)
        if name == "attention" and not applies("attention", model):
            value = "sdpa"
        if FIELDS[name].kind == SIZE and isinstance(value, float) and value.is_integer():
            value = int(value)
        fields[name] = value
    if fields["checkpoint"] not in FAMILIES[model].checkpoint_policies():  # an MLP has no attention to recompute
        fields["checkpoint"] = "full"
    if fields["finetune"] != "lora":  # the LoRA fields are hidden then: their values shape nothing
        fields.update(lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, lora_targets="")
    for name in ("lora_targets", "freeze"):
        fields[name] = str(fields[name] or "").replace(" ", "")  # "q_proj, v_proj" as typed
    for name in ("lora_rank", "lora_alpha"):
        if isinstance(fields[name], float) and fields[name].is_integer():
            fields[name] = int(fields[name])
    return fields


def _trusted_models(key: str, where=None) -> None:
    """Only when the server was started with GRAPHVIZ_CORE_TRUSTED_MODEL_DIR: pick one of that folder's factories.
    The options are the server's own listing; nothing typed in the browser names a file."""
    factories = trusted_factories()
    if not factories:
        return
    with (where or st.sidebar).expander("Your model (trusted folder)"):
        spec = st.selectbox(
            "Factory",
            factories,
            key=f"{key}.custom",
            help="file.py:function in the folder this server trusts; the function returns "
            "(module, example inputs, loss function)",
        )
        if st.button("Run your model", key=f"{key}.custom_run", width="stretch"):
            st.session_state[f"{key}.applied"] = ModelConfig(model=CUSTOM, preset=spec, device="cpu")
            st.session_state.pop(f"{key}.error", None)


def set_config(key: str, config: ModelConfig) -> None:
    """Load `config` into the form `key` and apply it, as if typed and run (call before the form is drawn, or from
    a widget callback)."""
    _load(key, config)
    config = _named(config)
    st.session_state[f"{key}.preset"] = preset_of(config)  # the preset it is, or "custom": never another preset
    st.session_state[f"{key}.previous"] = st.session_state.get(f"{key}.applied")
    st.session_state[f"{key}.applied"] = config
    st.session_state.pop(f"{key}.error", None)


def refuse(key: str, config: ModelConfig, sentence: str) -> bool:
    """A capture of `config`, the form's applied config, was refused (a freeze glob or a LoRA target that matches
    nothing): the form goes back to the config it applied before, whose result the page shows again under the
    sentence, as for a refused Run. False where there is none to go back to (the page then shows the sentence)."""
    previous = st.session_state.get(f"{key}.previous")
    if st.session_state.get(f"{key}.applied") != config or previous is None or previous == config:
        return False
    st.session_state[f"{key}.applied"] = previous
    st.session_state[f"{key}.previous"] = None
    st.session_state[f"{key}.error"] = sentence
    return True


def _run(key: str) -> None:
    """The form's button (a callback, so the preset box can still be set before it is drawn): apply the fields, or keep
    the config applied before and say why not."""
    dismiss_notices(key)
    try:
        config = _named(ModelConfig(**form_fields(key)))
        check_budget(config, resolve_device(config.device))
        if config.compile:  # what a compiled capture refuses (autocast, checkpointing, meta), refused before it runs
            from graphviz_core.capture.compiled import check_compile

            check_compile(config, resolve_device(config.device))
        st.session_state[f"{key}.previous"] = st.session_state.get(f"{key}.applied")
        st.session_state[f"{key}.applied"] = config
        st.session_state[f"{key}.preset"] = preset_of(config)
        st.session_state.pop(f"{key}.error", None)
    except ValueError as exc:
        st.session_state[f"{key}.error"] = str(exc)


FORM_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "preset")


def config_form(key: str = "config", where=None, submit_label: str = "Run backward pass") -> ModelConfig | None:
    """Draw the form in the sidebar (or in `where`, a container); return the config last applied (the default
    preset at first). `key` prefixes every widget key, so a page may draw two forms (A and B).

    A config that cannot run (invalid field, cuda missing, over the memory budget) is refused here with one
    message, and the config applied before stays, so the page keeps showing its result.
    """
    # The fields are widgets, whose values Streamlit drops after a run that did not draw them: on another page (the
    # explorer's form, then Beyond one GPU's) the family read MLP and the sizes 0 beside the preset still named.
    keep_widget_state(f"{key}.{name}" for name in (*FORM_FIELDS, "preset", "custom"))
    if f"{key}.preset" not in st.session_state:
        st.session_state[f"{key}.preset"] = DEFAULT_PRESET
        _load_preset(key)
        st.session_state[f"{key}.applied"] = config_from_preset(DEFAULT_PRESET)
    restore_from_link(key, lambda config: set_config(key, config))  # a shared link's config and view, once
    sidebar = where or st.sidebar
    _pickers(key, sidebar)
    _trusted_models(key, where)
    _finetune_picker(key, sidebar)
    # Refusals and "stale result" notices go here, above the fields, where they are seen without scrolling.
    notice = sidebar.empty()
    model = st.session_state[f"{key}.model"]
    with sidebar.form(f"{key}.form"):
        _fields(key, model)
        st.form_submit_button(submit_label, type="primary", width="stretch", on_click=_run, args=(key,))
    applied = st.session_state[f"{key}.applied"]
    _say_what_differs(key, applied, model, notice, where, submit_label)
    show_notices(key, where)  # what a link asked for and could not have, until the next Run
    sync_url(key, applied)
    copy_link(key, applied, sidebar)
    return applied


def _pickers(key: str, sidebar) -> None:
    """The preset and the model family: each loads its fields into the form."""
    custom = st.session_state[f"{key}.preset"] == NOT_A_PRESET
    sidebar.selectbox(
        "Preset",
        [*PRESETS, *([NOT_A_PRESET] if custom else [])],
        key=f"{key}.preset",
        on_change=_load_preset,
        args=(key,),
        help="Loads a preset into the fields below; change any field, then press the button under them. Once the config run is none of the "
        "presets, the box says so.",
    )
    sidebar.caption("None of the presets: the fields below are the config run." if custom
                    else PRESETS[st.session_state[f"{key}.preset"]].description)
    sidebar.selectbox(
        "Model family",
        MODELS,
        key=f"{key}.model",
        format_func=lambda model: FAMILIES[model].title,
        on_change=_load_family,
        args=(key,),
        help="Built-in teaching models, or a transformers architecture built from its config with "
        "random weights (nothing is downloaded). Switching loads that family's toy size.",
    )


def _fields(key: str, model: str) -> None:
    """Every field the family has, inside the form."""
    shown = [
        n
        for n in SIZE_FIELDS
        if applies(n, model)
    ]
    left, right = st.columns(2)
    for i, name in enumerate(shown):
        # No min/max on the widgets: an out-of-range value must reach the config check and be refused with a
        # sentence, not turn the field red while Run silently re-runs the previous config.
        (left if i % 2 == 0 else right).number_input(_label(name, model), step=1, key=f"{key}.{name}",
                                                     help=_zero_help(name, st.session_state[f"{key}.applied"]))
    _zero_caption(key, model, shown)
    if applies("tied", model):
        st.checkbox(_label("tied", model), key=f"{key}.tied", help=FIELD_HELP["tied"])
    if applies("attention", model):
        options = _attentions(model)
        if st.session_state.get(f"{key}.attention") not in options:
            st.session_state[f"{key}.attention"] = "sdpa"
        st.selectbox(
            _label("attention", model),
            options,
            key=f"{key}.attention",
            help="; ".join(f"{name}: {ATTENTION_HELP[name]}" for name in options),
        )
    st.selectbox(
        _label("checkpoint", model),
        CHECKPOINTS,
        key=f"{key}.checkpoint",
        help="full: each layer keeps only its input and re-runs its forward in backward; selective-attention: "
        "recompute the attention core only (Korthikanti et al.); selective-ops: keep the outputs of matmuls, "
        "convolutions and attention kernels, recompute the rest (torchtitan, keeping every matmul); "
        "selective-ops-torchtitan: torchtitan's own policy, which keeps the 1st, 3rd, 5th... matmul without a bias "
        "of each layer and the attention kernels' outputs, recomputes the rest",
    )
    left = right = st  # one per row: side by side, the dtype box read "bfloat1…" in the sidebar
    devices = _devices()
    if st.session_state.get(f"{key}.device") not in devices:
        st.session_state[f"{key}.device"] = "auto"
    left.selectbox(
        _label("device", model),
        devices,
        key=f"{key}.device",
        help="auto: CUDA if available, else CPU; meta: shapes only"
        + ("" if "cuda" in devices else "; cuda is not offered: this machine has none"),
    )
    right.selectbox(_label("dtype", model), DTYPES, key=f"{key}.dtype")
    st.selectbox(
        _label("autocast", model),
        AUTOCASTS,
        key=f"{key}.autocast",
        format_func=AUTOCAST_LABELS.get,
        help="Run the forward under torch.autocast: matmuls, linears and attention in 16 bits, the weights kept in "
        "the dtype above (fp32 master weights). Autocast's casts show as cast nodes; float16 also scales the loss "
        "with a GradScaler, as training does.",
    )
    st.selectbox(
        _label("optimizer", model),
        OPTIMIZERS,
        key=f"{key}.optimizer",
        format_func=OPTIMIZER_NAMES.get,
        help="The torch.optim optimizer stepped once after the backward: the memory panel counts the state it keeps "
        "(SGD none, SGD with momentum one buffer, Adam and AdamW two moments, Adafactor row and column factors).",
    )
    _finetune_fields(key, model)
    st.checkbox(
        _label("compile", model),
        key=f"{key}.compile",
        help="Capture the step under torch.compile: each compiled region's backward is one node, opened below the "
        "summary (its FX graph, what its forward saved, what it recomputes). Compiling takes seconds; inductor's "
        "partitioner decides what is saved, and no kernel code is generated. Not with mixed precision (autocast) or "
        "checkpointing: set those to none (refused before anything compiles).",
    )
    st.number_input(_label("seed", model), step=1, key=f"{key}.seed", help=f"0 to {SEED_MAX:,}")


# What 0 means in the fields where it means "the default", and that default for a config (the models' own rule)
ZERO_MEANS = {  # what 0 stands for (models.family.FIELD_ZERO) and the value it gives a config
    "kv_heads": (FIELD_ZERO["kv_heads"], lambda c: c.kv_heads or c.heads),
    "intermediate": (FIELD_ZERO["intermediate"], lambda c: c.intermediate or 4 * c.hidden),
    "context": (FIELD_ZERO["context"], lambda c: c.positions),
}


def _zero_help(name: str, applied: ModelConfig) -> str | None:
    """A size field's help: what it means (models.family.FIELD_HELP, as the CLI's --help says it), and for a field
    whose 0 means a default, that default and the value the result shown used."""
    meaning = FIELD_HELP.get(name)
    lead = f"{meaning[0].upper()}{meaning[1:]}. " if meaning else ""
    if name not in ZERO_MEANS:
        return lead.strip() or None
    means, used = ZERO_MEANS[name]
    unit = f" {FIELDS[name].unit}" if FIELDS[name].unit else ""
    shown = f" The result shown used {used(applied):,}{unit}." if applies(name, applied.model) else ""
    return f"{lead}0 means the default: {means}.{shown}"


def _zero_caption(key: str, model: str, shown: list[str]) -> None:
    """Under the sizes, where a field reads 0: the value that 0 stands for, from the fields as they are."""
    zeros = [name for name in shown if name in ZERO_MEANS and not st.session_state.get(f"{key}.{name}")]
    if not zeros:
        return
    try:
        config = ModelConfig(**{**form_fields(key), "freeze": "", "lora_targets": ""})
    except ValueError:  # the fields do not make a config (Run will say why): no default to compute
        return
    words = [f"{_label(name, model).split(' (')[0]} {ZERO_MEANS[name][1](config):,} ({ZERO_MEANS[name][0]})"
             for name in zeros]
    st.caption("0 means the default: " + "; ".join(words) + ".")


def _finetune_picker(key: str, sidebar) -> None:
    """Full fine-tuning or LoRA: outside the form, so that choosing LoRA shows its fields at once."""
    sidebar.selectbox(
        _label("finetune", st.session_state[f"{key}.model"]),
        FINETUNES,
        key=f"{key}.finetune",
        format_func=FINETUNE_LABELS.get,
        help="LoRA (peft): low-rank adapters A (r × in) and B (out × r) beside the chosen layers, every base weight "
        "frozen: frozen weights get no AccumulateGrad node, no gradient, no optimizer state and no weight-gradient "
        "matmul. The Memory and FLOPs tabs put it side by side with full fine-tuning.",
    )


def _finetune_fields(key: str, model: str) -> None:
    """LoRA's rank, alpha and targets (while LoRA is chosen) and the freeze glob."""
    if st.session_state.get(f"{key}.finetune") == "lora":
        left, right = st.columns(2)
        left.number_input(_label("lora_rank", model), step=1, key=f"{key}.lora_rank",
                          help="r: the adapters' inner width; each adapted layer gains r·(in + out) parameters")
        right.number_input(_label("lora_alpha", model), step=1, key=f"{key}.lora_alpha",
                           help="the adapter's output is scaled by alpha / r")
        family = FAMILIES[model]
        st.text_input(
            _label("lora_targets", model),
            key=f"{key}.lora_targets",
            placeholder=", ".join(family.lora_targets) or "e.g. convolution",
            help=f"module names, comma-separated (the end of a module's path, or a glob of the whole path); empty: "
            f"{family.lora_targets_note}",
        )
    st.text_input(
        _label("freeze", model),
        key=f"{key}.freeze",
        placeholder="e.g. *embed*",
        help="parameters whose names match this glob (fnmatch; comma-separated for several) get no gradient, with "
        "full fine-tuning or LoRA",
    )


def _say_what_differs(key: str, applied: ModelConfig, model: str, notice, where, submit_label: str) -> None:
    """A refused Run's sentence, or the fields the form holds that the result shown did not run with."""
    if f"{key}.error" in st.session_state:
        refused = escape_markdown(
            f"Not run: {in_form_words(st.session_state[f'{key}.error'], model)} The result shown is still that of the "
            "previous config."
        )
        notice.error(refused)
        if where is None:  # the Run button is at the sidebar's foot: say it where the results are too
            st.error(refused)
    elif not applied.family.user_code:
        # Named by the form's own labels ("Context"), not the config's field names ("context")
        changed = [
            _label(name, model).split(" (")[0]
            for name, value in form_fields(key).items()
            if getattr(applied, name) != value
        ]
        if changed:
            notice.warning(f"The form differs from the result shown ({', '.join(changed)}); press “{submit_label}” to "
                           "apply it.")
