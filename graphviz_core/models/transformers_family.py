"""What every Hugging Face `transformers` family shares: built from a config typed in code (never downloaded), with
random weights; on `meta` nothing is allocated. Each family (llama_style, gpt2_hf, bert, vision) says only what
differs: its `transformers` config, presets and shape rules.

Dropout probabilities are set to 0 (the model stays in training mode) so two runs of one config give the same graph
and numbers. The loss is computed outside the model's forward (the model is called without labels) so that the
loss's nodes are not charged to the model's modules. The torch side is graphviz_core.models.hf.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from graphviz_core.models.family import Batch, Family

if TYPE_CHECKING:
    from graphviz_core.config import ModelConfig


class TransformersFamily(Family):
    """A `transformers` architecture: subclasses give its config (`hf_config`), the Auto class that adds the head,
    the names to resolve, presets and shape rules; building, batches, losses and counts are shared."""

    attentions = ("sdpa", "eager")  # transformers' attn_implementation: fused SDPA, or its op-by-op reference
    spelled_out_attention = "eager"
    selective_alias = "selective-ops"  # what `selective` meant here: keep compute-heavy ops' outputs
    optional = ("intermediate",)
    auto_class = "AutoModelForCausalLM"
    config_class = ""
    model_class = ""  # the class the Auto class picks (resolved up front too)
    rotary = False  # route apply_rotary_pos_emb through a `rotary` child of each attention module
    images = False  # takes (B, 3, H, W) images and class labels instead of token ids

    hf_module = ""  # the family's folder in transformers.models

    @property
    def preload(self) -> tuple[str, ...]:
        return (f"transformers.models.{self.hf_module}.modeling_{self.hf_module}",)

    @property
    def transformers_names(self) -> tuple[str, ...]:
        return (self.auto_class, self.config_class, self.model_class)

    def hf_config(self, config: ModelConfig, tf):
        """The `transformers` config for `config`, built in code."""
        raise NotImplementedError

    def build(self, config: ModelConfig):
        from graphviz_core.models import hf

        return hf.build(self, config)

    def batch(self, config: ModelConfig, device) -> Batch:
        from graphviz_core.models import hf

        return hf.batch(self, config, device)

    def loss(self, config: ModelConfig, output, targets):
        from graphviz_core.models import hf

        return hf.loss(output, targets, upcast=self.language_model)  # float32 logits, as transformers' LM losses

    def parameter_count(self, config: ModelConfig) -> int:
        return _parameter_count(self, config)

    def activation_elements(self, config: ModelConfig) -> int:
        """Transformer layers: 16 per token per hidden unit (norm inputs, q/k/v/o inputs, residuals, upcasts) plus 3
        per token per MLP unit for every routed expert (SwiGLU's gate, up and product), plus the s x s scores where
        eager attention keeps them; the logits and their gradients for language models."""
        b = config.batch
        s, h = self.tokens(config), config.hidden
        inter = (config.intermediate or 4 * h) * max(1, config.experts_per_token)
        per_layer = s * b * (16 * h + 3 * inter)
        if config.attention == "eager":
            per_layer += 2 * config.heads * s * s * b
        logits = 3 * b * s * config.vocab if self.language_model else 0
        return config.layers * per_layer + logits


@lru_cache(maxsize=64)
def _parameter_count(family: TransformersFamily, config: ModelConfig) -> int:
    from graphviz_core.models import hf

    return hf.parameter_count(family, config)
