"""Model configurations: a frozen, validated `ModelConfig` and the named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

BUILT_IN = ("mlp", "block", "gpt2")
# Hugging Face `transformers` families (graphviz_core.families builds them from configs typed in code).
ROPE_FAMILIES = ("llama", "mistral", "qwen2", "mixtral")
HF_FAMILIES = (*ROPE_FAMILIES, "gpt2-hf", "bert", "vit", "resnet")
VISION = ("vit", "resnet")
MODELS = (*BUILT_IN, *HF_FAMILIES)
CUSTOM = "custom"  # a user's own nn.Module (graphviz_core.user_model); never offered by the form or --model
ATTENTIONS = ("sdpa", "mha", "manual", "eager")
BUILT_IN_ATTENTIONS = ("sdpa", "mha", "manual")
HF_ATTENTIONS = ("sdpa", "eager")  # transformers' attn_implementation: fused SDPA, or its op-by-op reference
RESNET_DEPTHS = (18, 34, 50, 101, 152)
VIT_PATCH = 16
SEED_MAX = 2**31 - 1  # torch.manual_seed takes up to 2**64 - 1; the form and CLI share one bound
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
    "kv_heads": 1_024,
    "intermediate": 262_144,
    "experts": 256,
    "experts_per_token": 256,
    "image_size": 4_096,
}

# The optional size fields (0 = not used / the family's default) and the families that have each.
OPTIONAL_FIELDS = {
    "kv_heads": ROPE_FAMILIES,
    "intermediate": (*ROPE_FAMILIES, "gpt2-hf", "bert", "vit"),
    "experts": ("mixtral",),
    "experts_per_token": ("mixtral",),
    "image_size": VISION,
    "context": ("gpt2", "gpt2-hf", "bert"),
}
FIELD_LABELS = {
    "kv_heads": "key-value heads",
    "intermediate": "intermediate (MLP) size",
    "experts": "experts",
    "experts_per_token": "experts per token",
    "image_size": "image size",
    "context": "context (position-embedding rows)",
    "seq": "sequence length (it takes images: set image_size)",
    "heads": "attention heads",
    "tied": "choice of tied embeddings",
}


def applies(name: str, model: str) -> bool:
    """Whether field `name` means something for `model` (the form hides it and the CLI refuses it otherwise)."""
    if name in OPTIONAL_FIELDS:
        return model in OPTIONAL_FIELDS[name]
    if name == "seq":
        return model not in VISION
    if name == "heads":
        return model not in ("mlp", "resnet")
    if name == "vocab":
        return model not in ("mlp", "block")
    if name == "tied":
        return model in ROPE_FAMILIES
    if name == "attention":
        return model not in ("mlp", "resnet")
    return True


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
    attention: str = "sdpa"  # fused kernel: the graph seed 000 says you should see
    checkpoint: str = "none"
    device: str = "auto"
    dtype: str = "float32"  # float32 everywhere: CPU half-precision matmuls are slow and partial
    seed: int = 0
    preset: str = ""  # the preset this config came from, for display only

    def __post_init__(self) -> None:
        if self.model == CUSTOM:
            return  # the fields describe nothing: the user's module decides its own shapes
        _check_choice("model", self.model, MODELS)
        _check_choice("attention", self.attention, ATTENTIONS)
        hf = self.model in HF_FAMILIES
        if hf and self.attention not in HF_ATTENTIONS:
            raise ValueError(
                f"model {self.model!r} runs transformers' attention: choose sdpa or eager, not {self.attention!r}."
            )
        if not hf and self.attention == "eager":
            raise ValueError(
                f"attention 'eager' is for the transformers families; model {self.model!r} takes sdpa, mha or manual."
            )
        for name in OPTIONAL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0 (0 means unused or the default), got {value!r}.")
            if value > LIMITS[name]:
                raise ValueError(
                    f"{name} {value} is above the limit of {LIMITS[name]:,}; this tool refuses it to protect the machine."
                )
            if value and not applies(name, self.model):
                raise ValueError(
                    f"model {self.model!r} has no {FIELD_LABELS[name]}; leave {name} at 0 (it applies to: "
                    f"{', '.join(OPTIONAL_FIELDS[name])})."
                )
        if not isinstance(self.tied, bool):
            raise ValueError(f"tied must be true or false, got {self.tied!r}.")
        if self.tied and not applies("tied", self.model):
            raise ValueError(f"model {self.model!r} has no choice of tied embeddings; leave tied off.")
        if hf:
            self._check_family()
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
        if not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be between 0 and {SEED_MAX:,}, got {self.seed}.")
        if self.model not in ("mlp", "resnet") and self.hidden % self.heads:
            raise ValueError(
                f"hidden {self.hidden} is not divisible by {self.heads} heads; "
                f"pick a hidden size that is a multiple of {self.heads} (e.g. {self.heads * max(1, self.hidden // self.heads)})."
            )
        if self.model in ("gpt2", "gpt2-hf", "bert") and self.context and self.seq > self.context:
            raise ValueError(
                f"seq {self.seq} is longer than the context {self.context} (position-embedding rows); "
                f"lower seq or raise context."
            )
        if self.model == "block" and self.layers != 1:
            raise ValueError(f"model 'block' is exactly one transformer block; layers must be 1, got {self.layers}.")
        if self.model == "mlp" and self.attention != "sdpa":
            # Accept the default silently but refuse an explicit attention choice that would do nothing.
            raise ValueError("model 'mlp' has no attention; leave attention at its default 'sdpa'.")
        if self.model == "mlp" and self.checkpoint == "selective":
            raise ValueError(
                "selective checkpointing recomputes attention, and model 'mlp' has none; use 'full' or 'none'."
            )

    def _check_family(self) -> None:
        """Shape rules of the transformers families, each refused with the fix."""
        if self.model in ROPE_FAMILIES:
            kv = self.kv_heads or self.heads
            if self.heads % kv:
                raise ValueError(
                    f"{self.heads} heads are not divisible by {kv} key-value heads; pick key-value heads "
                    f"that divide {self.heads} (e.g. {_divisor_near(self.heads, kv)})."
                )
            if (self.hidden // self.heads) % 2:
                raise ValueError(
                    f"head size {self.hidden // self.heads} (hidden / heads) is odd; rotary embeddings rotate "
                    f"pairs of dimensions, so pick hidden and heads giving an even head size."
                )
        if self.model == "mixtral":
            if not self.experts or not self.experts_per_token:
                raise ValueError("model 'mixtral' needs experts and experts_per_token (Mixtral 8x7B: 8 and 2).")
            if self.experts_per_token > self.experts:
                raise ValueError(
                    f"experts_per_token {self.experts_per_token} is more than the {self.experts} experts; "
                    f"lower it to at most {self.experts}."
                )
        if self.model in VISION and not self.image_size:
            raise ValueError(f"model {self.model!r} takes images: set image_size (e.g. 224).")
        if self.model == "vit" and self.image_size % VIT_PATCH:
            raise ValueError(
                f"image_size {self.image_size} is not a multiple of ViT's {VIT_PATCH}-pixel patches; "
                f"pick e.g. {max(VIT_PATCH, self.image_size // VIT_PATCH * VIT_PATCH)}."
            )
        if self.model == "resnet":
            if self.layers not in RESNET_DEPTHS:
                raise ValueError(
                    f"model 'resnet' takes layers as its depth, one of {', '.join(map(str, RESNET_DEPTHS))}; "
                    f"got {self.layers}."
                )
            if self.image_size < 32:
                raise ValueError(
                    f"image_size {self.image_size} is too small for ResNet's five halvings; use at least 32."
                )

    @property
    def tokens(self) -> int:
        """Positions per example the model sees: seq, or for ViT the patches plus the class token."""
        if self.model == "vit":
            return (self.image_size // VIT_PATCH) ** 2 + 1
        return self.seq

    def describe(self, device: str | None = None) -> str:
        """What this config is, in a few words, whatever preset it started from (`llama · 2 layers · h=64 …`).

        `device`: the device a capture actually ran on, in place of the requested one (which may be `auto`).
        """
        device = device or self.device
        if self.model == CUSTOM:
            return f"custom module {self.preset} · b={self.batch} · {self.dtype} · {device}"
        parts = [
            self.model,
            f"{self.layers} layer{'' if self.layers == 1 else 's'}" if self.model != "resnet" else f"depth {self.layers}",
            f"h={self.hidden}",
        ]
        if applies("heads", self.model):
            heads = f"{self.heads} heads"
            if self.kv_heads and self.kv_heads != self.heads:
                heads += f" / {self.kv_heads} kv"
            parts.append(heads)
        if self.experts:
            parts.append(f"{self.experts} experts, top-{self.experts_per_token}")
        parts.append(f"b={self.batch}")
        parts.append(f"{self.image_size}px" if self.model in VISION else f"s={self.seq}")
        parts += [self.dtype, device]
        return " · ".join(parts)

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


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - k))


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


@dataclass(frozen=True)
class Preset:
    """A named starting config and the sentence that says what it is for."""

    name: str
    description: str
    fields: dict = field(default_factory=dict)


def _tiny(model: str, what: str, **fields) -> Preset:
    return Preset(
        f"{model}-tiny",
        f"{what} at toy size: a real backward on CPU in about a second.",
        dict(model=model, batch=2, seq=32, **fields),
    )


def _meta(model: str, **fields) -> dict:
    """Published sizes: shapes-only dry run at bfloat16 on meta (the weights alone would not fit here)."""
    return dict(model=model, batch=1, dtype="bfloat16", device="meta", **fields)


_ROPE_TINY = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512)
_LLAMA_70B = dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=128256, seq=8192)

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
            "One pre-LN transformer block as in the textbook: h=768, 12 heads, nn.MultiheadAttention, 4h GELU MLP, "
            "two residuals.",
            dict(model="block", hidden=768, heads=12, layers=1, batch=4, seq=128, attention="mha"),
        ),
        Preset(
            "gpt2-small",
            "GPT-2 small: 12 layers, h=768, 12 heads, V=50257, context 1024, tied embeddings (124M parameters).",
            dict(model="gpt2", hidden=768, heads=12, layers=12, vocab=50257, batch=1, seq=1024, context=1024),
        ),
        Preset(
            "gpt2-blocks-at-llama-70b-width",
            "GPT-2-style blocks (LayerNorm, 4h GELU MLP, full multi-head attention) at Llama-3.1-70B's width and depth "
            "(80 layers, h=8192, 64 heads, V=128256, s=8192, bf16); not Llama itself: see llama-3.1-70b.",
            dict(
                model="gpt2",
                hidden=8192,
                heads=64,
                layers=80,
                vocab=128256,
                batch=1,
                seq=8192,
                context=8192,
                dtype="bfloat16",
                device="meta",
            ),
        ),
        _tiny("llama", "Llama (RMSNorm, rotary positions, grouped-query attention, SwiGLU)", **_ROPE_TINY),
        Preset(
            "llama-3.2-1b",
            "Llama 3.2 1B: 16 layers, h=2048, 32 query / 8 key-value heads, SwiGLU 8192, "
            "V=128256, tied embeddings (1.24B parameters); s=8192 on meta.",
            _meta(
                "llama",
                hidden=2048,
                intermediate=8192,
                layers=16,
                heads=32,
                kv_heads=8,
                vocab=128256,
                tied=True,
                seq=8192,
            ),
        ),
        Preset(
            "llama-3.1-8b",
            "Llama 3.1 8B: 32 layers, h=4096, 32 query / 8 key-value heads, SwiGLU 14336, "
            "V=128256 (8.03B parameters); s=8192 on meta.",
            _meta("llama", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256, seq=8192),
        ),
        Preset(
            "llama-3.1-70b",
            "Llama 3.1 70B: 80 layers, h=8192, 64 query / 8 key-value heads, SwiGLU 28672, "
            "V=128256 (70.6B parameters); s=8192 on meta.",
            _meta("llama", **_LLAMA_70B),
        ),
        Preset(
            "llama-70b-shape",
            "The activation-memory question for Llama 3.1 70B (s=8192, b=1, bf16) on the real "
            "architecture: the same config as llama-3.1-70b.",
            _meta("llama", **_LLAMA_70B),
        ),
        Preset(
            "llama-3.1-405b",
            "Llama 3.1 405B: 126 layers, h=16384, 128 query / 8 key-value heads, SwiGLU 53248, "
            "V=128256 (406B parameters); s=8192 on meta.",
            _meta("llama", hidden=16384, intermediate=53248, layers=126, heads=128, kv_heads=8, vocab=128256, seq=8192),
        ),
        _tiny("mistral", "Mistral (Llama-style layers, no sliding window)", **_ROPE_TINY),
        Preset(
            "mistral-7b",
            "Mistral 7B v0.3: 32 layers, h=4096, 32 query / 8 key-value heads, SwiGLU 14336, V=32768 "
            "(7.25B parameters); s=4096 on meta.",
            _meta("mistral", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=32768, seq=4096),
        ),
        _tiny("qwen2", "Qwen2.5 (Llama-style layers with q/k/v biases)", **_ROPE_TINY),
        Preset(
            "qwen2.5-7b",
            "Qwen2.5 7B: 28 layers, h=3584, 28 query / 4 key-value heads, SwiGLU 18944, V=152064, "
            "biases on q/k/v (7.62B parameters); s=4096 on meta.",
            _meta("qwen2", hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064, seq=4096),
        ),
        _tiny(
            "mixtral",
            "Mixtral (mixture of experts: 4 experts, each token routed to 2)",
            **_ROPE_TINY,
            experts=4,
            experts_per_token=2,
        ),
        Preset(
            "mixtral-8x7b",
            "Mixtral 8x7B: 32 layers, h=4096, 32 query / 8 key-value heads, 8 SwiGLU experts of "
            "14336, 2 per token, V=32000 (46.7B parameters, 12.9B active); s=4096 on meta.",
            _meta(
                "mixtral",
                hidden=4096,
                intermediate=14336,
                layers=32,
                heads=32,
                kv_heads=8,
                vocab=32000,
                experts=8,
                experts_per_token=2,
                seq=4096,
            ),
        ),
        _tiny(
            "gpt2-hf",
            "GPT-2 in Hugging Face's implementation",
            hidden=64,
            intermediate=256,
            layers=2,
            heads=4,
            vocab=512,
            context=32,
        ),
        *[
            Preset(
                f"gpt2-hf-{size}",
                f"GPT-2 {size} in Hugging Face's implementation: {layers} layers, h={h}, {heads} "
                f"heads, V=50257, context 1024, tied embeddings ({params} parameters); s=1024.",
                dict(
                    model="gpt2-hf",
                    hidden=h,
                    intermediate=4 * h,
                    layers=layers,
                    heads=heads,
                    vocab=50257,
                    context=1024,
                    batch=1,
                    seq=1024,
                    device="meta" if layers > 12 else "auto",
                ),
            )
            for size, h, layers, heads, params in (
                ("small", 768, 12, 12, "124M"),
                ("medium", 1024, 24, 16, "355M"),
                ("large", 1280, 36, 20, "774M"),
                ("xl", 1600, 48, 25, "1.56B"),
            )
        ],
        _tiny(
            "bert",
            "BERT (post-LN encoder, masked-language-model head)",
            hidden=64,
            intermediate=256,
            layers=2,
            heads=4,
            vocab=512,
            context=64,
        ),
        Preset(
            "bert-base",
            "BERT-base uncased as a masked language model: 12 layers, h=768, 12 heads, 3072, "
            "V=30522, 512 positions (110M parameters); s=512.",
            dict(
                model="bert",
                hidden=768,
                intermediate=3072,
                layers=12,
                heads=12,
                vocab=30522,
                context=512,
                batch=1,
                seq=512,
            ),
        ),
        Preset(
            "vit-tiny",
            "ViT (image classification, 16-pixel patches) at toy size: 32-pixel images, 2 layers, h=64; "
            "a real backward on CPU in about a second.",
            dict(model="vit", hidden=64, intermediate=256, layers=2, heads=4, vocab=10, image_size=32, batch=2),
        ),
        Preset(
            "vit-base",
            "ViT-base/16 for ImageNet: 12 layers, h=768, 12 heads, 3072, 224-pixel images, 1000 classes "
            "(86.6M parameters).",
            dict(model="vit", hidden=768, intermediate=3072, layers=12, heads=12, vocab=1000, image_size=224, batch=8),
        ),
        Preset(
            "resnet-tiny",
            "ResNet-18's layout (basic blocks 2-2-2-2) at width 8 on 32-pixel images, 10 classes: "
            "a real backward on CPU in about a second.",
            dict(model="resnet", hidden=8, layers=18, vocab=10, image_size=32, batch=2),
        ),
        Preset(
            "resnet-50",
            "ResNet-50 for ImageNet: bottleneck blocks 3-4-6-3, widths 256..2048, 224-pixel images, "
            "1000 classes (25.6M parameters).",
            dict(model="resnet", hidden=64, layers=50, vocab=1000, image_size=224, batch=8),
        ),
    )
}

DEFAULT_PRESET = "gpt2-tiny"


def config_from_preset(name: str, **overrides) -> ModelConfig:
    """The preset's config with `overrides` (fields left as None are ignored) applied on top."""
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
MODEL_DEFAULTS = {
    "mlp": PRESETS["mlp"].fields,
    "block": dict(model="block", hidden=64, heads=4, layers=1, batch=2, seq=32),
    "gpt2": PRESETS["gpt2-tiny"].fields,
    **{family: PRESETS[f"{family}-tiny"].fields for family in HF_FAMILIES},
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
    given = {k: v for k, v in overrides.items() if v is not None}
    _refuse_fields_that_do_not_apply(model, given)
    fields = {**MODEL_DEFAULTS[model], **given}
    return ModelConfig(**fields)


def _refuse_fields_that_do_not_apply(model: str, given: dict) -> None:
    """A field typed for a family that has no such thing is an error, not silently dropped."""
    for name in given:
        if name in ("seq", "heads", "tied", *OPTIONAL_FIELDS) and not applies(name, model):
            raise ValueError(f"model {model!r} has no {FIELD_LABELS[name]}; drop the {name} setting.")
        if name == "attention" and not applies(name, model):
            raise ValueError(f"model {model!r} has no attention; drop the attention setting.")
