"""Model configurations: a frozen, validated `ModelConfig` and the named presets."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from graphviz_core.fields import CHOICE, FIELDS
from graphviz_core.models.family import CHECKPOINTS, FIELD_WORDS, OPTIONAL_FIELDS, SELECTIVE, Preset
from graphviz_core.models.registry import FAMILIES, OFFERED, PRESETS, RENAMED_PRESETS, family_named

__all__ = ["PRESETS", "Preset", "FAMILIES", "ModelConfig", "applies", "config_from_preset", "resolve_config"]

MODELS = OFFERED  # what --model and the form's family box offer
CUSTOM = "custom"  # a user's own nn.Module (graphviz_core.models.custom); never offered by the form or --model
ATTENTIONS = FIELDS["attention"].choices
SEED_MAX = 2**31 - 1  # torch.manual_seed takes up to 2**64 - 1; the form and CLI share one bound
# CHECKPOINTS (graphviz_core.models.family): none, full, selective-attention, selective-ops,
# selective-ops-torchtitan; `selective` is accepted and resolved to the family's own meaning of it
# (Family.selective_alias), so old links keep working.
DEVICES = FIELDS["device"].choices
DTYPES = FIELDS["dtype"].choices
# The training step as people run it (docs/training-step.md): ops under torch.autocast with the weights left in
# `dtype` (fp32 master weights), LoRA adapters from peft or full fine-tuning, the torch.optim optimizer whose state
# is counted, and the step under torch.compile.
AUTOCASTS = FIELDS["autocast"].choices
FINETUNES = FIELDS["finetune"].choices
OPTIMIZERS = FIELDS["optimizer"].choices
LORA_RANK, LORA_ALPHA = 8, 16  # peft's usual r=8 and alpha = 2r
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets")
_NAME_LIST = re.compile(r"[A-Za-z0-9_.*?\[\]-]+(,[A-Za-z0-9_.*?\[\]-]+)*")

# Structural ceilings. They keep a typo (hidden=76800) from hanging the machine; memory budgets per
# device are checked separately before a capture runs (graphviz_core.capture.device.check_budget).
LIMITS = {name: f.limit for name, f in FIELDS.items() if f.limit}


def choices_of(name: str) -> tuple[str, ...]:
    """The options of a choice field (graphviz_core.fields): the families offered and the checkpointing policies are
    declared by the models, the others in the field's declaration."""
    if FIELDS[name].kind != CHOICE:
        raise ValueError(f"{name} is not a choice field.")
    return {"model": MODELS, "checkpoint": CHECKPOINTS}.get(name, FIELDS[name].choices)


def applies(name: str, model: str) -> bool:
    """Whether field `name` means something for `model` (the form hides it and the CLI refuses it otherwise)."""
    return family_named(model).takes(name)


def families_taking(name: str) -> tuple[str, ...]:
    """The offered families that take field `name`."""
    return tuple(m for m in MODELS if FAMILIES[m].takes(name))


@dataclass(frozen=True)
class ModelConfig:
    """One model and batch to capture; every field is checked on construction."""

    model: str = "gpt2"
    hidden: int = 64  # small enough that the default capture takes well under a second on a CPU
    heads: int = 4  # head dim 16: divides 64 and keeps attention non-trivial
    layers: int = 2  # two blocks show the repeated structure without hiding it
    vocab: int = 512  # GPT-2's 50257 would make lm_head dominate a toy model
    batch: int = 2
    seq: int = 32
    context: int = 0  # position-embedding rows for gpt2, gpt2-hf, bert; 0 means "same as seq"
    kv_heads: int = 0  # grouped-query attention (llama-style families); 0 means "same as heads"
    intermediate: int = 0  # MLP width of the transformers families; 0 means 4·hidden
    experts: int = 0  # mixtral: experts per layer
    experts_per_token: int = 0  # mixtral: experts each token is routed to
    image_size: int = 0  # vit, resnet: square images of this many pixels a side
    tied: bool = False  # llama-style families: lm_head shares the token embedding (Llama 3.2 1B does)
    attention: str = "sdpa"  # fused kernel: the graph "Why Your Transformer Block Has 50 Backward Nodes" says you should see
    checkpoint: str = "none"
    device: str = "auto"
    dtype: str = "float32"  # float32 everywhere: CPU half-precision matmuls are slow and partial
    autocast: str = "none"  # bfloat16/float16: ops under torch.autocast, weights stay in dtype (fp32 master weights)
    finetune: str = "full"  # lora: peft adapters on lora_targets, the base weights frozen
    lora_rank: int = LORA_RANK
    lora_alpha: int = LORA_ALPHA
    lora_targets: str = ""  # module names, comma-separated; empty: the family's attention query and value projections
    freeze: str = ""  # parameter names matching this glob (fnmatch) get no gradient, e.g. "*embed*"
    optimizer: str = "adamw"  # the torch.optim optimizer whose state the training step counts
    compile: bool = False  # the step under torch.compile
    seed: int = 0
    preset: str = ""  # the preset this config came from, for display only

    def __post_init__(self) -> None:
        if self.model == CUSTOM:
            return  # the fields describe nothing: the user's module decides its own shapes
        _check_choice("model", self.model, MODELS)
        _check_choice("attention", self.attention, ATTENTIONS)
        family = FAMILIES[self.model]
        for name in OPTIONAL_FIELDS:
            value = getattr(self, name)
            if name == "tied":
                if not isinstance(value, bool):
                    raise ValueError(f"tied must be true or false, got {value!r}.")
                if value and not family.takes("tied"):
                    raise ValueError(f"model {self.model!r} has no choice of tied embeddings; leave tied off.")
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0 (0 means unused or the default), got {value!r}.")
            if value > LIMITS[name]:
                raise ValueError(
                    f"{name} {value} is above the limit of {LIMITS[name]:,}; this tool refuses it to protect the machine."
                )
            if value and not family.takes(name):
                raise ValueError(
                    f"model {self.model!r} has no {FIELD_WORDS[name]}; leave {name} at 0 (it applies to: "
                    f"{', '.join(families_taking(name))})."
                )
        _check_choice("checkpoint", self.checkpoint, CHECKPOINTS)
        if self.checkpoint == SELECTIVE and family.selective_alias:
            object.__setattr__(self, "checkpoint", family.selective_alias)
        _check_choice("device", self.device, DEVICES)
        _check_choice("dtype", self.dtype, DTYPES)
        self._check_training_step()
        for name in ("hidden", "heads", "layers", "vocab", "batch", "seq"):
            _check_size(name, getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be a whole number, got {self.seed!r}.")
        if not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be between 0 and {SEED_MAX:,}, got {self.seed}.")
        family.validate(self)

    def _check_training_step(self) -> None:
        """autocast, finetune, the LoRA settings, freeze, optimizer and compile: each refused with the fix."""
        _check_choice("autocast", self.autocast, AUTOCASTS)
        _check_choice("finetune", self.finetune, FINETUNES)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true or false, got {self.compile!r}.")
        for name in ("lora_rank", "lora_alpha"):
            _check_size(name, getattr(self, name))
        for name in ("lora_targets", "freeze"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > 200 or (value and not _NAME_LIST.fullmatch(value)):
                raise ValueError(
                    f"{name} takes parameter or module names (letters, digits, _ . - and the wildcards * ? [ ]), "
                    f"comma-separated, at most 200 characters; got {str(value)[:60]!r}."
                )
        if self.finetune != "lora" and (self.lora_rank, self.lora_alpha, self.lora_targets) != (LORA_RANK, LORA_ALPHA, ""):
            raise ValueError("lora_rank, lora_alpha and lora_targets shape LoRA adapters; set finetune to lora, or drop them.")

    @property
    def family(self):
        """The family this config's model belongs to (graphviz_core.models.family.Family)."""
        return FAMILIES[self.model]

    @property
    def tokens(self) -> int:
        """Positions per example the model sees: seq, or for ViT the patches plus the class token."""
        return FAMILIES[self.model].tokens(self)

    def describe(self, device: str | None = None) -> str:
        """What this config is, in a few words, whatever preset it started from (`llama · 2 layers · h=64 …`).

        `device`: the device a capture actually ran on, in place of the requested one (which may be `auto`).
        """
        family = FAMILIES[self.model]
        size = family.sample_size(self)
        parts = [*family.describe(self), f"b={self.batch}", *([size] if size else []), self.dtype, device or self.device]
        tuning = self.finetuning_words()
        return " · ".join([*parts, *([tuning] if tuning else [])])

    def finetuning_words(self) -> str:
        """How this config fine-tunes, in words ("LoRA r=8, alpha 16 on q_proj, v_proj; frozen: *embed*"); "" for
        full fine-tuning with nothing frozen."""
        parts = []
        if self.finetune == "lora":
            targets = self.lora_targets.replace(",", ", ") or ", ".join(self.family.default_lora_targets(self))
            parts.append(f"LoRA r={self.lora_rank}, alpha {self.lora_alpha} on {targets}")
        if self.freeze:
            parts.append(f"frozen: {self.freeze.replace(',', ', ')}")
        return "; ".join(parts)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def positions(self) -> int:
        """Rows of the position embedding (gpt2)."""
        return self.context or self.seq

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def shown(self) -> dict:
        """The fields that describe this config, as the JSON and the pages echo it: those its family takes (a ResNet
        has no heads or sequence length) and the LoRA settings only when fine-tuning with LoRA."""
        lora = self.finetune == "lora"
        return {k: v for k, v in self.to_dict().items() if self.family.takes(k) and (lora or k not in LORA_FIELDS)}

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}.")


def _check_size(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be a whole number, got {value!r}.")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}.")
    if value > LIMITS[name]:
        raise ValueError(
            f"{name} {value} is above the limit of {LIMITS[name]:,}; this tool refuses it to protect the machine."
        )


DEFAULT_PRESET = "gpt2-tiny"


def preset_named(name: str) -> str:
    """The preset `name` is now called: a former name (RENAMED_PRESETS) gives the preset it became."""
    return RENAMED_PRESETS.get(name, name)


def config_from_preset(name: str, **overrides) -> ModelConfig:
    """The preset's config with `overrides` (fields left as None are ignored) applied on top; a preset's former name
    gives the preset it became."""
    name = preset_named(name)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}.")
    given = {k: v for k, v in overrides.items() if v is not None}
    model = given.get("model", PRESETS[name].fields.get("model", ModelConfig.model))
    _refuse_fields_that_do_not_apply(model, {k: v for k, v in given.items() if k != "model"})
    fields = {**PRESETS[name].fields, **given}
    unknown = set(fields) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ValueError(f"unknown config field(s): {', '.join(sorted(unknown))}.")
    return ModelConfig(**fields, preset=name)


# What `--model X` starts from when no preset is named: each model's smallest sensible shape.
MODEL_DEFAULTS = {name: FAMILIES[name].default_fields for name in MODELS}


def resolve_config(preset: str | None = None, **overrides) -> ModelConfig:
    """The config a user asked for: a preset (or the chosen model's defaults) plus explicit overrides.

    Overrides left as None are ignored, so CLI flags and form fields map straight onto this.
    """
    if preset:
        return config_from_preset(preset, **overrides)
    model = overrides.get("model") or ModelConfig.model
    if model not in MODEL_DEFAULTS:
        _check_choice("model", model, MODELS)
    given = {k: v for k, v in overrides.items() if v is not None}
    _refuse_fields_that_do_not_apply(model, given)
    fields = {**MODEL_DEFAULTS[model], **given}
    return ModelConfig(**fields)


def _refuse_fields_that_do_not_apply(model: str, given: dict) -> None:
    """A field typed for a family that has no such thing is an error, not silently dropped."""
    family = family_named(model)
    for name in given:
        if name in ("seq", "heads", *OPTIONAL_FIELDS) and not family.takes(name):
            raise ValueError(f"model {model!r} has no {FIELD_WORDS[name]}; drop the {name} setting.")
        if name == "attention" and not family.takes(name):
            raise ValueError(f"model {model!r} has no attention; drop the attention setting.")


def field_help(name: str, zero: bool = True) -> str | None:
    """A config field's help (its declaration, graphviz_core.fields), with what a 0 stands for where it stands for a
    default (and `zero`: the caller takes a 0); for a field only some families take, which ones, read from their
    declarations (Family.takes), so the list cannot drift from what the config accepts."""
    field = FIELDS[name]
    if not field.help:
        return None
    text = field.help
    if zero and field.zero:
        text += f"; 0: {field.zero}"
    if name not in OPTIONAL_FIELDS:
        return text
    taking = [m for m in MODELS if FAMILIES[m].takes(name) and FAMILIES[m].offered]
    return f"{text} ({', '.join(taking)})"
