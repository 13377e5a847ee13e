"""Model configurations: a frozen, validated `ModelConfig` and the named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MODELS = ("mlp", "block", "gpt2")
ATTENTIONS = ("sdpa", "mha", "manual")
CHECKPOINTS = ("none", "full", "selective")
DEVICES = ("auto", "cpu", "cuda", "meta")
DTYPES = ("float32", "bfloat16", "float16")

# Structural ceilings. They keep a typo (hidden=76800) from hanging the machine; memory budgets per
# device are checked separately before a capture runs (graphviz_core.device.check_budget).
LIMITS = {
    "hidden": 65_536,
    "heads": 1_024,
    "layers": 256,
    "vocab": 1_048_576,
    "batch": 65_536,
    "seq": 1_048_576,
    "context": 1_048_576,
}


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
    context: int = 0  # position-embedding rows for gpt2; 0 means "same as seq"
    attention: str = "sdpa"  # fused kernel: the graph seed 000 says you should see
    checkpoint: str = "none"
    device: str = "auto"
    dtype: str = "float32"  # float32 everywhere: CPU half-precision matmuls are slow and partial
    seed: int = 0
    preset: str = ""  # the preset this config came from, for display only

    def __post_init__(self) -> None:
        _check_choice("model", self.model, MODELS)
        _check_choice("attention", self.attention, ATTENTIONS)
        _check_choice("checkpoint", self.checkpoint, CHECKPOINTS)
        _check_choice("device", self.device, DEVICES)
        _check_choice("dtype", self.dtype, DTYPES)
        for name in ("hidden", "heads", "layers", "vocab", "batch", "seq"):
            _check_size(name, getattr(self, name))
        if not isinstance(self.context, int) or isinstance(self.context, bool) or self.context < 0:
            raise ValueError(f"context must be a whole number >= 0 (0 means 'same as seq'), got {self.context!r}.")
        if self.context > LIMITS["context"]:
            raise ValueError(f"context {self.context} is above the limit of {LIMITS['context']}.")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be a whole number, got {self.seed!r}.")
        if self.model != "mlp" and self.hidden % self.heads:
            raise ValueError(
                f"hidden {self.hidden} is not divisible by {self.heads} heads; "
                f"pick a hidden size that is a multiple of {self.heads} (e.g. {self.heads * max(1, self.hidden // self.heads)})."
            )
        if self.model == "gpt2" and self.context and self.seq > self.context:
            raise ValueError(
                f"seq {self.seq} is longer than the context {self.context} (position-embedding rows); "
                f"lower seq or raise context."
            )
        if self.model == "block" and self.layers != 1:
            raise ValueError(f"model 'block' is exactly one transformer block; layers must be 1, got {self.layers}.")
        if self.model != "gpt2" and self.context:
            raise ValueError("context only applies to model 'gpt2' (position embeddings); leave it at 0.")
        if self.model == "mlp" and self.attention != "sdpa":
            # Accept the default silently but refuse an explicit attention choice that would do nothing.
            raise ValueError("model 'mlp' has no attention; leave attention at its default 'sdpa'.")
        if self.model == "mlp" and self.checkpoint == "selective":
            raise ValueError("selective checkpointing recomputes attention, and model 'mlp' has none; use 'full' or 'none'.")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def positions(self) -> int:
        """Rows of the position embedding (gpt2)."""
        return self.context or self.seq

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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
        raise ValueError(f"{name} {value} is above the limit of {LIMITS[name]:,}; this tool refuses it to protect the machine.")


@dataclass(frozen=True)
class Preset:
    """A named starting config and the sentence that says what it is for."""

    name: str
    description: str
    fields: dict = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "gpt2-tiny",
            "GPT-2 architecture at toy size (2 layers, h=64, 4 heads, V=512): captures in well under a second.",
            dict(model="gpt2", hidden=64, heads=4, layers=2, vocab=512, batch=2, seq=32),
        ),
        Preset(
            "mlp",
            "Linear -> GELU -> Linear, twice, with an MSE loss: the smallest graph worth reading.",
            dict(model="mlp", hidden=64, layers=2, batch=4, seq=8),
        ),
        Preset(
            "seed-block",
            "Seed 000's block: pre-LN, h=768, 12 heads, nn.MultiheadAttention, 4h GELU MLP, two residuals.",
            dict(model="block", hidden=768, heads=12, layers=1, batch=4, seq=128, attention="mha"),
        ),
        Preset(
            "gpt2-small",
            "GPT-2 small: 12 layers, h=768, 12 heads, V=50257, context 1024, tied embeddings (124M parameters).",
            dict(model="gpt2", hidden=768, heads=12, layers=12, vocab=50257, batch=1, seq=1024, context=1024),
        ),
        Preset(
            "llama-70b-shape",
            "Seed 002's Llama-3.1-70B shape (80 layers, h=8192, 64 heads, V=128256, s=8192, b=1, bf16) built from "
            "GPT-2-style blocks (LayerNorm, 4h GELU MLP, full multi-head attention), not Llama's RMSNorm/SwiGLU/GQA; "
            "for meta dry runs.",
            dict(
                model="gpt2", hidden=8192, heads=64, layers=80, vocab=128256, batch=1, seq=8192, context=8192,
                dtype="bfloat16", device="meta",
            ),
        ),
    )
}

DEFAULT_PRESET = "gpt2-tiny"


def config_from_preset(name: str, **overrides) -> ModelConfig:
    """The preset's config with `overrides` (fields left as None are ignored) applied on top."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}.")
    fields = {**PRESETS[name].fields, **{k: v for k, v in overrides.items() if v is not None}}
    unknown = set(fields) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ValueError(f"unknown config field(s): {', '.join(sorted(unknown))}.")
    return ModelConfig(**fields, preset=name)

# What `--model X` starts from when no preset is named: each model's smallest sensible shape.
MODEL_DEFAULTS = {
    "mlp": PRESETS["mlp"].fields,
    "block": dict(model="block", hidden=64, heads=4, layers=1, batch=2, seq=32),
    "gpt2": PRESETS["gpt2-tiny"].fields,
}


def resolve_config(preset: str | None = None, **overrides) -> ModelConfig:
    """The config a user asked for: a preset (or the chosen model's defaults) plus explicit overrides.

    Overrides left as None are ignored, so CLI flags and form fields map straight onto this.
    """
    if preset:
        return config_from_preset(preset, **overrides)
    model = overrides.get("model") or ModelConfig.model
    if model not in MODEL_DEFAULTS:
        _check_choice("model", model, MODELS)
    fields = {**MODEL_DEFAULTS[model], **{k: v for k, v in overrides.items() if v is not None}}
    return ModelConfig(**fields)
