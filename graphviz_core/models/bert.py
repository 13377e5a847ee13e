"""BERT from `transformers` as a masked language model: a post-LN encoder with learned positions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphviz_core.models.family import ParallelPlan, Preset
from graphviz_core.models.llama_style import tiny
from graphviz_core.models.transformers_family import TransformersFamily

if TYPE_CHECKING:
    from graphviz_core.config import ModelConfig


class Bert(TransformersFamily):
    name = "bert"
    title = "BERT (masked LM)"
    optional = ("intermediate", "context")
    hf_module = "bert"
    auto_class, config_class, model_class = "AutoModelForMaskedLM", "BertConfig", "BertForMaskedLM"
    parallel = ParallelPlan(
        no_tensor="BERT's attention and MLP take their hidden states by position where Llama's take them by keyword, "
        "and three of its projections share one name (dense), so no column / row plan is declared for it",
        no_stages="BERT is an encoder: its masked-language-model head reads every position, and no causal decoder's "
        "embedding, layers, norm and head are declared to cut between",
        no_ring="BERT's attention is bidirectional and masks padding with an attention mask, which torch's ring "
        "attention does not take",
        no_sequence="no column / row plan is declared for BERT, and sequence parallel runs inside one (see TP)",
    )
    lora_targets = ("query", "value")  # BertSelfAttention's query and value projections
    presets = (
        tiny("bert", "BERT (post-LN encoder, masked-language-model head)", hidden=64, intermediate=256, layers=2,
             heads=4, vocab=512, context=64),
        Preset(
            "bert-base",
            "BERT-base uncased as a masked language model: 12 layers, h=768, 12 heads, 3072, "
            "V=30522, 512 positions (110M parameters); s=512.",
            dict(model="bert", hidden=768, intermediate=3072, layers=12, heads=12, vocab=30522, context=512, batch=1,
                 seq=512),
        ),
    )
    default_fields = presets[0].fields

    def hf_config(self, config: ModelConfig, tf):
        return tf.BertConfig(
            hidden_size=config.hidden,
            num_hidden_layers=config.layers,
            num_attention_heads=config.heads,
            intermediate_size=config.intermediate or 4 * config.hidden,
            vocab_size=config.vocab,
            max_position_embeddings=config.positions,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            use_cache=False,
            attn_implementation=config.attention,
        )


FAMILIES = (Bert(),)
