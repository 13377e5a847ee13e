"""GPT-2 in Hugging Face's implementation (`GPT2LMHeadModel`): learned positions, LayerNorm, 4h GELU MLP, tied
embeddings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphviz_core.models.family import ParallelPlan, Preset, StageSplit
from graphviz_core.models.llama_style import tiny
from graphviz_core.models.transformers_family import TransformersFamily

if TYPE_CHECKING:
    import torch
    from torch import nn

    from graphviz_core.config import ModelConfig


def after_the_embeddings(model: nn.Module, hidden: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """A GPT-2 pipeline stage after the first: its blocks, then (last stage) the final LayerNorm and the head, on the
    hidden states the stage before sent. `GPT2Model.forward` would add the position embedding to them again
    (`inputs_embeds + wpe(position_ids)`): Megatron-LM's GPT keeps word and position embeddings in one embedding
    module on the first stage, and so does this split. The causal mask is the one GPT2Model makes."""
    import torch

    body = model.transformer
    if positions is None:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = causal_mask(body.config, hidden, positions)
    for block in body.h:
        # by keyword: the second and third places changed within 5.x (5.0: past_key_values, cache_position); and
        # 5.0's block gives a tuple whose first item is the hidden states
        hidden = block(hidden, attention_mask=mask, use_cache=False, position_ids=positions)
        if isinstance(hidden, tuple):
            hidden = hidden[0]
    return model.lm_head(body.ln_f(hidden))


def causal_mask(config, hidden: torch.Tensor, positions: torch.Tensor):
    """transformers' `create_causal_mask` for a stage's hidden states, without a cache. Its keywords changed within
    5.x (5.24: `inputs_embeds`, `cache`; 5.17: `past_key_values`, and earlier `input_embeds` and a required
    `cache_position`): the names this install's function takes are used."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    takes = inspect.signature(create_causal_mask).parameters
    given = {"config": config, "attention_mask": None, "position_ids": positions}
    given["inputs_embeds" if "inputs_embeds" in takes else "input_embeds"] = hidden
    for cache in ("cache", "past_key_values"):
        if cache in takes:
            given[cache] = None
    if "cache_position" in takes:
        given["cache_position"] = positions[0]
    return create_causal_mask(**given)


class GPT2HF(TransformersFamily):
    name = "gpt2-hf"
    title = "GPT-2 (Hugging Face)"
    optional = ("intermediate", "context")
    hf_module = "gpt2"
    config_class, model_class = "GPT2Config", "GPT2LMHeadModel"
    hidden_grows = "matmuls grow as hidden², GELU and LayerNorm as hidden"
    # GPT-2 computes q, k and v in one Conv1D: an adapter there adapts all three at once (its B spans 3h outputs),
    # as peft's own default for GPT-2 does.
    lora_targets = ("c_attn",)
    lora_targets_note = "the fused query/key/value projection c_attn: one adapter spans q, k and v"
    parallel = ParallelPlan(
        no_tensor="GPT-2 writes its projections as Conv1D (the weight transposed), which torch's column / row "
        "parallel styles (nn.Linear and nn.Embedding only) do not split",
        # The head is tied to the token embedding: the last stage keeps its own copy, and the two gradients are
        # summed between the first and the last stage once per step (graphviz_core.parallel.pipeline).
        stages=StageSplit("transformer.wte", "transformer.h", "transformer.ln_f", "lm_head",
                          first_only=("transformer.wpe",), later_forward=after_the_embeddings),
        ring_attention=True,
        no_sequence="sequence parallel runs inside tensor parallel, which GPT-2's Conv1D projections keep out (see TP)",
    )
    presets = (
        tiny("gpt2-hf", "GPT-2 in Hugging Face's implementation", hidden=64, intermediate=256, layers=2, heads=4,
             vocab=512, context=32),
        *[
            Preset(
                f"gpt2-hf-{size}",
                f"GPT-2 {size} in Hugging Face's implementation: {layers} layers, h={h}, {heads} "
                f"heads, V=50257, context 1024, tied embeddings ({params} parameters); s=1024.",
                dict(model="gpt2-hf", hidden=h, intermediate=4 * h, layers=layers, heads=heads, vocab=50257,
                     context=1024, batch=1, seq=1024, device="meta" if layers > 12 else "auto"),
            )
            for size, h, layers, heads, params in (
                ("small", 768, 12, 12, "124M"),
                ("medium", 1024, 24, 16, "355M"),
                ("large", 1280, 36, 20, "774M"),
                ("xl", 1600, 48, 25, "1.56B"),
            )
        ],
    )
    default_fields = presets[0].fields

    def hf_config(self, config: ModelConfig, tf):
        return tf.GPT2Config(
            n_embd=config.hidden,
            n_layer=config.layers,
            n_head=config.heads,
            n_inner=config.intermediate or 4 * config.hidden,
            vocab_size=config.vocab,
            # GPT-2's end-of-text token (its beginning and end of sequence) is the last of its vocabulary: 50,256 of
            # 50,257. GPT2Config keeps 50,256 for any vocabulary, and transformers warns for a smaller one.
            bos_token_id=config.vocab - 1,
            eos_token_id=config.vocab - 1,
            n_positions=config.positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            attn_implementation=config.attention,
        )


FAMILIES = (GPT2HF(),)
