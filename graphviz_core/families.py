"""Hugging Face `transformers` architectures built from configs typed in here (never downloaded): the model,
its example batch and its loss, for the capture.

Every model gets random weights from `AutoModelFor…from_config`; on `meta` nothing is allocated. Dropout
probabilities are set to 0 (the model stays in training mode) so two runs of one config give the same
graph and numbers. The loss is computed outside the model's forward (the model is called without
labels) so that the loss's nodes are not charged to the model's modules.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from functools import lru_cache, partial

# Nothing here may reach the Hugging Face hub: configs are built in code and weights are random.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts  # noqa: E402

from graphviz_core.config import ModelConfig  # noqa: E402
from graphviz_core.models import CHECKPOINT_KWARGS  # noqa: E402

LANGUAGE = ("llama", "mistral", "qwen2", "mixtral", "gpt2-hf", "bert")
VISION = ("vit", "resnet")
HF_FAMILIES = LANGUAGE + VISION
ROPE = ("llama", "mistral", "qwen2", "mixtral")

# ResNet depth -> (blocks per stage, block type), as in He et al. 2016, Table 1.
RESNET_DEPTHS = {
    18: ([2, 2, 2, 2], "basic"),
    34: ([3, 4, 6, 3], "basic"),
    50: ([3, 4, 6, 3], "bottleneck"),
    101: ([3, 4, 23, 3], "bottleneck"),
    152: ([3, 8, 36, 3], "bottleneck"),
}
VIT_PATCH = 16  # ViT-base/16: 16 x 16 pixel patches

# Set on modules whose forward runs under torch.utils.checkpoint (same attribute as models.RECOMPUTED).
_RECOMPUTED = "recomputed_in_backward"

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


KEPT_BYTES = "selective_checkpoint_kept_bytes"  # set on the model: what SELECTIVE_POLICY stored in forward


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
_CAUSAL = "AutoModelForCausalLM"
_FAMILY_NAMES = {
    "llama": (_CAUSAL, "LlamaConfig", "LlamaForCausalLM"),
    "mistral": (_CAUSAL, "MistralConfig", "MistralForCausalLM"),
    "qwen2": (_CAUSAL, "Qwen2Config", "Qwen2ForCausalLM"),
    "mixtral": (_CAUSAL, "MixtralConfig", "MixtralForCausalLM"),
    "gpt2-hf": (_CAUSAL, "GPT2Config", "GPT2LMHeadModel"),
    "bert": ("AutoModelForMaskedLM", "BertConfig", "BertForMaskedLM"),
    "vit": ("AutoModelForImageClassification", "ViTConfig", "ViTForImageClassification"),
    "resnet": ("AutoModelForImageClassification", "ResNetConfig", "ResNetForImageClassification"),
}
_TRANSFORMERS_READY: set[str] = set()  # families whose names are resolved


def transformers_for(family: str):
    """The `transformers` module with every name `family` uses already resolved (thread-safe)."""
    if family not in _TRANSFORMERS_READY:
        with _TRANSFORMERS_LOCK:  # the import too: a second thread importing meanwhile sees a half-built module
            if family not in _TRANSFORMERS_READY:
                import transformers

                for name in _FAMILY_NAMES[family]:
                    getattr(transformers, name)
                _TRANSFORMERS_READY.add(family)
    import transformers

    return transformers


def hf_config(config: ModelConfig):
    """The `transformers` config for `config` (a family in HF_FAMILIES), built in code."""
    tf = transformers_for(config.model)

    fam = config.model
    h, layers, heads, vocab = config.hidden, config.layers, config.heads, config.vocab
    inter = config.intermediate or 4 * h
    kv = config.kv_heads or heads
    common = dict(use_cache=False, attn_implementation=config.attention)
    if fam in ROPE:
        kwargs = dict(
            hidden_size=h,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            vocab_size=vocab,
            max_position_embeddings=max(config.seq, 8192),
            attention_dropout=0.0,
            tie_word_embeddings=config.tied,
            **common,
        )
        if fam == "llama":
            return tf.LlamaConfig(rope_theta=500000.0, **kwargs)
        if fam == "mistral":
            return tf.MistralConfig(sliding_window=None, **kwargs)
        if fam == "qwen2":
            return tf.Qwen2Config(use_sliding_window=False, **kwargs)
        return tf.MixtralConfig(
            num_local_experts=config.experts,
            num_experts_per_tok=config.experts_per_token,
            router_jitter_noise=0.0,
            output_router_logits=False,
            experts_implementation=_experts_implementation(config),
            **kwargs,
        )
    if fam == "gpt2-hf":
        return tf.GPT2Config(
            n_embd=h,
            n_layer=layers,
            n_head=heads,
            n_inner=inter,
            vocab_size=vocab,
            n_positions=config.positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    if fam == "bert":
        return tf.BertConfig(
            hidden_size=h,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=inter,
            vocab_size=vocab,
            max_position_embeddings=config.positions,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
    if fam == "vit":
        return tf.ViTConfig(
            hidden_size=h,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=inter,
            image_size=config.image_size,
            patch_size=VIT_PATCH,
            num_labels=vocab,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
    depths, kind = RESNET_DEPTHS[layers]
    widths = [h, 2 * h, 4 * h, 8 * h]  # output channels per stage: 64..512 for ResNet-18/34 at h=64
    if kind == "bottleneck":
        widths = [4 * w for w in widths]  # 256..2048 for ResNet-50 (expansion 4)
    return tf.ResNetConfig(
        embedding_size=h,
        hidden_sizes=widths,
        depths=depths,
        layer_type=kind,
        num_labels=vocab,
    )


def _experts_implementation(config: ModelConfig) -> str:
    """Mixtral's experts as training runs them: the grouped matmul (tokens sorted by expert, one GEMM per expert's
    rows, `torch._grouped_mm`), which saves each token's activations for backward and keeps the weights as they are.
    It runs on CPU (any dtype, torch 2.9 on) and on meta, so the graph is the same on both.

    Where this torch has no `_grouped_mm`, the batched-matmul form: each token's k expert weight matrices gathered,
    then one bmm. It too runs everywhere, but autograd keeps the gathered copies: tokens × k × an expert's weights
    (Mixtral-8x7B at s=4096: 2.7 TiB per layer, against 1.5 GiB with the grouped matmul). `transformers`' default
    loop selects tokens with `nonzero()`, which meta cannot run."""
    return "grouped_mm" if hasattr(torch, "_grouped_mm") else "batched_mm"


def build_hf_model(config: ModelConfig) -> nn.Module:
    """The `transformers` model for `config` with random weights, on the current default device."""
    tf = transformers_for(config.model)

    hf = hf_config(config)
    head = {
        "bert": tf.AutoModelForMaskedLM,
        "vit": tf.AutoModelForImageClassification,
        "resnet": tf.AutoModelForImageClassification,
    }.get(config.model, tf.AutoModelForCausalLM)
    _no_packed_sequences_on_meta()
    model = head.from_config(hf, dtype=_dtype(config))
    if config.model in ROPE:
        _route_rotary_through_modules(model)
    if config.checkpoint != "none":
        _checkpoint_layers(model, selective=config.checkpoint == "selective")
    return model


def _dtype(config: ModelConfig) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[config.dtype]


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
        setattr(layer, _RECOMPUTED, True)


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


def make_hf_batch(config: ModelConfig, device, gen: torch.Generator | None):
    """(inputs, targets): token ids and next tokens (random), or images and class labels (random)."""
    b = config.batch
    if config.model in VISION:
        shape = (b, 3, config.image_size, config.image_size)
        if gen is None:
            return torch.empty(shape, dtype=_dtype(config), device="meta"), torch.empty(
                b, dtype=torch.long, device="meta"
            )
        images = torch.randn(shape, generator=gen, device=device).to(_dtype(config))
        return images, torch.randint(config.vocab, (b,), generator=gen, device=device)
    shape = (b, config.seq)
    if gen is None:
        return torch.empty(shape, dtype=torch.long, device="meta"), torch.empty(shape, dtype=torch.long, device="meta")
    return (
        torch.randint(config.vocab, shape, generator=gen, device=device),
        torch.randint(config.vocab, shape, generator=gen, device=device),
    )


def hf_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits: per token for language models (bert: every position, as if every token
    were masked), per image for classifiers."""
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@lru_cache(maxsize=64)
def parameter_count(config: ModelConfig) -> int:
    """Exact parameters of the model `config` builds, counted on meta (no memory; ~0.1 s for Llama 70B)."""
    with torch.device("meta"):
        model = build_hf_model(config.replace(checkpoint="none", preset=""))
    return sum(p.numel() for p in model.parameters())


def activation_elements(config: ModelConfig) -> int:
    """A rough upper estimate of the elements kept for backward by the whole model (admission only).

    Transformer layers: 16 per token per hidden unit (norm inputs, q/k/v/o inputs, residuals, upcasts) plus 3 per
    token per MLP unit for every routed expert (SwiGLU's gate, up and product), plus the s x s scores where eager
    attention keeps them; the logits and their gradients for language models. ResNet: about half an element per
    pixel per channel of the stem width per layer of depth (its early stages dominate).
    """
    b = config.batch
    if config.model == "resnet":
        return b * config.image_size**2 * config.hidden * config.layers // 2
    s, h = config.tokens, config.hidden
    inter = (config.intermediate or 4 * h) * max(1, config.experts_per_token)
    per_layer = s * b * (16 * h + 3 * inter)
    if config.attention == "eager":
        per_layer += 2 * config.heads * s * s * b
    logits = 3 * b * s * config.vocab if config.model in LANGUAGE else 0
    return config.layers * per_layer + logits


def training_flops(config: ModelConfig) -> int:
    """Rough forward + backward FLOPs (admission only): 6 per parameter per token (Mixtral: per active parameter),
    plus attention's 12·b·s²·h per layer; ResNet: 6 per parameter per 16 x 16 pixel patch."""
    params = parameter_count(config)
    if config.model == "resnet":
        return 6 * params * config.batch * (config.image_size // 16) ** 2
    if config.model == "mixtral":
        h, inter = config.hidden, config.intermediate or 4 * config.hidden
        params -= (config.experts - config.experts_per_token) * config.layers * 3 * h * inter
    s = config.tokens
    return 6 * params * config.batch * s + 12 * config.layers * config.batch * s * s * config.hidden
