"""The torch side of the Hugging Face `transformers` families (graphviz_core.models.transformers_family): building a
model from a config typed in code (never downloaded), checkpointing its layers or its attention cores, and routing
rotary embeddings through modules.

Every model gets random weights from `AutoModelFor…from_config`; on `meta` nothing is allocated. Dropout
probabilities are set to 0 (the model stays in training mode) so two runs of one config give the same
graph and numbers. The loss is computed outside the model's forward (the model is called without
labels) so that the loss's nodes are not charged to the model's modules.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

# Nothing here may reach the Hugging Face hub: configs are built in code and weights are random.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from graphviz_core.models.checkpoint_policies import CHECKPOINT_KWARGS, RECOMPUTED, SELECTIVE_OPS_CONTEXTS  # noqa: E402
from graphviz_core.models.family import Batch  # noqa: E402
from graphviz_core.models.teaching import TORCH_DTYPES  # noqa: E402

if TYPE_CHECKING:
    from graphviz_core.config import ModelConfig

# `transformers` resolves its names lazily on first access, and two threads resolving at once (two sessions opening
# their first transformers configs on a fresh server) can get "module 'transformers' has no attribute
# 'AutoModelForMaskedLM'" (tests/test_admission.py races 8 threads). A family's names, the model class its Auto class
# picks included, are resolved once under a lock before any use. Only that family's: resolving every family's would
# import the model code of all of them, seconds in a fresh process, where a request needs one.
_TRANSFORMERS_LOCK = threading.Lock()
_TRANSFORMERS_READY: set[str] = set()  # families whose names are resolved


def transformers_for(family: str, names: tuple[str, ...]):
    """The `transformers` module with `names` (everything `family` uses) already resolved (thread-safe)."""
    if family not in _TRANSFORMERS_READY:
        with _TRANSFORMERS_LOCK:  # the import too: a second thread importing meanwhile sees a half-built module
            if family not in _TRANSFORMERS_READY:
                import transformers

                for name in names:
                    getattr(transformers, name)
                _TRANSFORMERS_READY.add(family)
    import transformers

    return transformers


def _layers(model: nn.Module) -> list[nn.Module]:
    """The repeated layers that checkpointing wraps: transformer layers, or ResNet's residual blocks."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not found:
        found = [m for m in model.modules() if type(m).__name__ in ("ResNetBottleNeckLayer", "ResNetBasicLayer")]
    return found


def _checkpoint_layers(model: nn.Module, context_fn: Callable | None) -> None:
    """Run each layer's forward under torch.utils.checkpoint: whole (`full`, no context_fn) or with a selective
    policy's contexts (`selective-ops`, `selective-ops-torchtitan`)."""
    for layer in _layers(model):
        forward = layer.forward

        def run(*args, _forward=forward, **kwargs):
            if context_fn is None:
                return checkpoint(_forward, *args, **CHECKPOINT_KWARGS, **kwargs)
            return checkpoint(_forward, *args, **CHECKPOINT_KWARGS, context_fn=context_fn, **kwargs)

        layer.forward = run
        setattr(layer, RECOMPUTED, True)


class RecomputedCoreAttention(nn.Module):
    """The core of one `transformers` attention module (its attention function: eager's q·kᵀ, scale, mask, softmax
    and ·v, or the fused SDPA kernel), run as this child under torch.utils.checkpoint for `selective-attention`: the
    checkpoint keeps the function's inputs (q, k, v and the mask) and re-runs it in backward. A module of its own so
    that the capture attributes the core's ops to it and sees the re-run."""

    def forward(self, function: Callable, owner: nn.Module, *args, **kwargs):
        return function(owner, *args, **kwargs)


_ROUTED: dict[str, Callable] = {}  # modeling module or "sdpa" -> the attention function before routing
_ROUTING_LOCK = threading.Lock()  # two builds at once must not wrap a function twice (a checkpoint in a checkpoint)


def _routed(original: Callable) -> Callable:
    """`original` (an attention function, called with its attention module first) run through that module's
    RecomputedCoreAttention child under checkpoint when it has one, as is otherwise."""

    def attention(module, *args, **kwargs):
        core = getattr(module, "core", None)
        if isinstance(core, RecomputedCoreAttention):
            return checkpoint(core, original, module, *args, **CHECKPOINT_KWARGS, **kwargs)
        return original(module, *args, **kwargs)

    return attention


def _innermost_attention(model: nn.Module) -> list[nn.Module]:
    """The modules that call the attention function: named `…Attention`, with no `…Attention` child (BERT's and ViT's
    outer attention holds the self-attention and the output projection)."""
    def named(m: nn.Module) -> bool:
        return type(m).__name__.endswith("Attention")

    return [m for m in model.modules() if named(m) and not any(named(c) for c in m.children())]


def _checkpoint_attention_cores(model: nn.Module) -> None:
    """`selective-attention`: give every attention module a RecomputedCoreAttention child and route the modeling
    file's eager function and the shared SDPA function through it (plain calls for modules without one)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for module in _innermost_attention(model):
        modeling = sys.modules[type(module).__module__]
        with _ROUTING_LOCK:
            if "sdpa" not in _ROUTED:
                _ROUTED["sdpa"] = ALL_ATTENTION_FUNCTIONS["sdpa"]
                ALL_ATTENTION_FUNCTIONS["sdpa"] = _routed(_ROUTED["sdpa"])
            if modeling.__name__ not in _ROUTED:
                _ROUTED[modeling.__name__] = modeling.eager_attention_forward
                modeling.eager_attention_forward = _routed(_ROUTED[modeling.__name__])
        module.core = RecomputedCoreAttention()
        setattr(module.core, RECOMPUTED, True)


class ApplyRotary(nn.Module):
    """Rotary position embedding applied to q and k (RoPE): `transformers`' own function, run inside this module
    so the graph attributes its ops to the attention layer's `rotary` child and categorises them as position."""

    def __init__(self, apply: Callable) -> None:
        super().__init__()
        self.apply_fn = apply

    def forward(self, q, k, cos, sin, *args, **kwargs):
        return self.apply_fn(q, k, cos, sin, *args, **kwargs)


_CURRENT = threading.local()  # the attention module whose forward is running, per thread
_PATCHED: dict[str, Callable] = {}


def _route_rotary_through_modules(model: nn.Module) -> None:
    """Give every attention module an ApplyRotary child and make the modeling file's module-level
    `apply_rotary_pos_emb` call it while that attention module runs (plain call otherwise)."""
    import sys

    for module in list(model.modules()):
        name = type(module).__name__
        if not name.endswith("Attention"):
            continue
        modeling = sys.modules[type(module).__module__]
        original = _PATCHED.get(modeling.__name__)
        if original is None:
            original = modeling.apply_rotary_pos_emb
            _PATCHED[modeling.__name__] = original

            def routed(q, k, cos, sin, *args, _original=original, **kwargs):
                owner = getattr(_CURRENT, "attention", None)
                if owner is None or not hasattr(owner, "rotary"):
                    return _original(q, k, cos, sin, *args, **kwargs)
                return owner.rotary(q, k, cos, sin, *args, **kwargs)

            modeling.apply_rotary_pos_emb = routed
        module.rotary = ApplyRotary(original)
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_leave, always_call=True)


def _no_packed_sequences_on_meta() -> None:
    """`transformers` checks position ids for packed sequences with a data-dependent `.all()`, which meta tensors
    cannot answer. Our batches are never packed (positions 0..s-1 in every row), so the answer is always none."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    if getattr(original, "graphviz_core", False):
        return

    def find(position_ids, *args, **kwargs):
        return None  # on every device, so that CPU and meta run the same ops

    find.graphviz_core = True
    masking_utils.find_packed_sequence_indices = find


def _enter(module, args):
    _CURRENT.attention = module


def _leave(module, args, output):
    _CURRENT.attention = None


def build(family, config: ModelConfig) -> nn.Module:
    """`family`'s model for `config` with random weights, on the current default device, in training mode."""
    tf = transformers_for(family.name, family.transformers_names)
    hf = family.hf_config(config, tf)
    _no_packed_sequences_on_meta()
    model = getattr(tf, family.auto_class).from_config(hf, dtype=TORCH_DTYPES[config.dtype])
    # the weights the config ties (a head tied to the token embedding) shared again: transformers 5.0 leaves them two
    # tensors when built under a meta default device (`with torch.device("meta")`, as pipeline stages are); 5.17 on
    # ties them there too, and tying tied weights changes nothing
    model.tie_weights()
    if family.rotary:
        _route_rotary_through_modules(model)
    if config.checkpoint == "full":
        _checkpoint_layers(model, None)
    elif config.checkpoint in SELECTIVE_OPS_CONTEXTS:  # selective-ops, selective-ops-torchtitan
        _checkpoint_layers(model, SELECTIVE_OPS_CONTEXTS[config.checkpoint](model))
    elif config.checkpoint == "selective-attention":
        _checkpoint_attention_cores(model)
    return model.train()


def batch(family, config: ModelConfig, device) -> Batch:
    """Token ids and next tokens (random), or images and class labels (random); empty tensors on meta."""
    b, meta = config.batch, str(device) == "meta"
    gen = None if meta else torch.Generator(device=device).manual_seed(config.seed + 1)
    if family.images:
        shape = (b, 3, config.image_size, config.image_size)
        if meta:
            return Batch(torch.empty(shape, dtype=TORCH_DTYPES[config.dtype], device="meta"),
                         torch.empty(b, dtype=torch.long, device="meta"))
        images = torch.randn(shape, generator=gen, device=device).to(TORCH_DTYPES[config.dtype])
        return Batch(images, torch.randint(config.vocab, (b,), generator=gen, device=device))
    shape = (b, config.seq)
    if meta:
        return Batch(torch.empty(shape, dtype=torch.long, device="meta"), torch.empty(shape, dtype=torch.long, device="meta"))
    return Batch(
        torch.randint(config.vocab, shape, generator=gen, device=device),
        torch.randint(config.vocab, shape, generator=gen, device=device),
    )


def loss(output, targets: torch.Tensor, upcast: bool) -> torch.Tensor:
    """Cross-entropy of the logits: per token for language models (bert: every position, as if every token were
    masked), per image for classifiers. With `upcast` the logits are copied to float32 first, as transformers'
    ForCausalLMLoss and ForMaskedLMLoss do ("Upcast to float if we need to compute the loss to avoid potential
    precision issues"; its image classifiers' loss does not): in 16-bit a float32 copy of the b·s·V logits (4 B each)
    and a float32 log-softmax saved for backward. Nothing on float32 logits (`.float()` returns the same tensor), and
    not under autocast, whose cross_entropy already casts the logits to float32 (its float32 op list): an explicit
    copy there would only move that cast before the flatten (a conversion node instead of autocast's cast)."""
    logits = output.logits
    if upcast and not any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def parameter_count(family, config: ModelConfig) -> int:
    """Exact parameters of the model `config` builds, counted on meta (no memory; ~0.1 s for Llama 70B)."""
    with torch.device("meta"):
        model = build(family, config.replace(checkpoint="none", preset=""))
    return sum(p.numel() for p in model.parameters())
