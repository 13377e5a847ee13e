"""The torch side of the Hugging Face `transformers` families (graphviz_core.models.transformers_family): building a
model from a config typed in code (never downloaded), checkpointing its layers, and routing rotary embeddings
through modules.

Every model gets random weights from `AutoModelFor…from_config`; on `meta` nothing is allocated. Dropout
probabilities are set to 0 (the model stays in training mode) so two runs of one config give the same
graph and numbers. The loss is computed outside the model's forward (the model is called without
labels) so that the loss's nodes are not charged to the model's modules.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

# Nothing here may reach the Hugging Face hub: configs are built in code and weights are random.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts  # noqa: E402

from graphviz_core.models.family import Batch  # noqa: E402
from graphviz_core.models.teaching import CHECKPOINT_KWARGS, KEPT_BYTES, RECOMPUTED, TORCH_DTYPES  # noqa: E402

if TYPE_CHECKING:
    from graphviz_core.config import ModelConfig

# Selective checkpointing policy for every family: keep the outputs of the matrix multiplications and
# attention kernels (expensive to recompute), recompute everything else (norms, activations, rotary,
# elementwise: cheap per byte kept). Korthikanti et al.'s selective scheme keeps the GEMMs and recomputes the
# attention core; keeping the fused kernel's output is the analogue when no s x s scores exist.
_KEEP = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}
SELECTIVE_POLICY = "keep the outputs of matmuls, convolutions and attention kernels; recompute the rest"




def _policy(model: nn.Module, ctx, op, *args, **kwargs):
    if op not in _KEEP:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        # The checkpoint stores these outputs itself, where no saved-tensor hook sees them; count their bytes by
        # running the op on meta copies of its arguments (shapes only, no arithmetic).
        # With the dispatch modes below this one switched off: the capture's FLOP counter and storage observer
        # would otherwise count this shape computation as a second forward op (llama-tiny's forward read
        # 25.3 MFLOP under selective instead of 14.8).
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            meta = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
            out = op(*meta[0], **meta[1])
        kept = sum(
            t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
        )
        setattr(model, KEPT_BYTES, getattr(model, KEPT_BYTES, 0) + kept)
    return CheckpointPolicy.MUST_SAVE


# `transformers` resolves its names lazily on first access, and two threads resolving at once (two sessions opening
# their first transformers configs on a fresh server) got "module 'transformers' has no attribute
# 'AutoModelForMaskedLM'" (up to 7 of 8 threads in tests/test_admission.py's repro). A family's names, the model
# class its Auto class picks included, are resolved once under a lock before any use. Only that family's: resolving
# all eight families' took 2.2 s more in a fresh process (BertForMaskedLM alone 0.5 s) than Llama's own.
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


def _checkpoint_layers(model: nn.Module, selective: bool) -> None:
    """Run each layer's forward under torch.utils.checkpoint: whole (`full`) or with SELECTIVE_POLICY."""
    context_fn = partial(create_selective_checkpoint_contexts, partial(_policy, model)) if selective else None
    for layer in _layers(model):
        forward = layer.forward

        def run(*args, _forward=forward, **kwargs):
            if context_fn is None:
                return checkpoint(_forward, *args, **CHECKPOINT_KWARGS, **kwargs)
            return checkpoint(_forward, *args, **CHECKPOINT_KWARGS, context_fn=context_fn, **kwargs)

        layer.forward = run
        setattr(layer, RECOMPUTED, True)


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
    if family.rotary:
        _route_rotary_through_modules(model)
    if config.checkpoint != "none":
        _checkpoint_layers(model, selective=config.checkpoint == "selective")
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


def loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits: per token for language models (bert: every position, as if every token were
    masked), per image for classifiers."""
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def parameter_count(family, config: ModelConfig) -> int:
    """Exact parameters of the model `config` builds, counted on meta (no memory; ~0.1 s for Llama 70B)."""
    with torch.device("meta"):
        model = build(family, config.replace(checkpoint="none", preset=""))
    return sum(p.numel() for p in model.parameters())
