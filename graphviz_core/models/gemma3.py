"""Gemma 3 (text) from `transformers` (`gemma3_text`: Gemma3TextConfig, Gemma3ForCausalLM), added through the family
registry alone.

A Gemma 3 decoder layer is Llama-shaped (RMSNorm, rotary positions, grouped-query attention, a gated MLP) with these
differences, all kept here:

- five sliding-window layers to one global layer: `layer_types` repeats 5 x "sliding_attention" then 1 x
  "full_attention" (layers 5, 11, 17, 23 are global in the 26-layer 1B). Sliding layers see the last
  SLIDING_WINDOW = 512 tokens (Gemma 3 1B's window; the larger Gemma 3 models use 1024) and rotate with base
  10,000; global layers see every earlier token and rotate with base 1,000,000. The window is the published 512
  at every size, the toy one included, so it shows only where seq > 512: a toy window would be a shape nobody
  trained;
- QK-norm: an RMSNorm over each head of q and of k before the rotary embedding;
- four RMSNorms per layer (before and after attention, before and after the MLP: "sandwich" norms), each scaling
  by (1 + weight), and the token embedding scaled by sqrt(hidden);
- a GELU (tanh approximation) gated MLP (GeGLU) instead of SwiGLU: still three matmuls;
- tied input/output embeddings and a 262,144-token vocabulary;
- a head size that is not hidden / heads. ModelConfig has no head-size field, so the family derives it: the
  published widths keep their published head size (PUBLISHED_HEAD_DIM: Gemma 3 1B is hidden 1152 with 4 heads of
  256, not 1152 / 4 = 288), any other width uses hidden / heads. Attention scores are scaled by
  query_pre_attn_scalar^-1/2 with query_pre_attn_scalar = head size (256 in the 1B), the usual 1/sqrt(head size).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphviz_core.models.family import DECODER_STAGES, ParallelPlan, Preset
from graphviz_core.models.llama_style import LlamaStyle, divisor_near, on_meta
from graphviz_core.models.transformers_family import TransformersFamily

if TYPE_CHECKING:
    from graphviz_core.config import ModelConfig

SLIDING_WINDOW = 512  # tokens a sliding layer attends to (Gemma 3 1B's config.json: "sliding_window": 512)
SLIDING_PATTERN = 6  # every sixth layer is global: five sliding layers to one global
ROPE_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # global / local rotary bases
# Published widths whose head size is not hidden / heads: Gemma 3 1B (hidden 1152, 4 heads of 256).
PUBLISHED_HEAD_DIM = {1152: 256}
MAX_POSITIONS = 32_768  # Gemma 3 1B's context


def layer_types(layers: int) -> list[str]:
    """Gemma 3's layer pattern: layer i is global when (i + 1) is a multiple of 6, sliding otherwise."""
    return ["full_attention" if (i + 1) % SLIDING_PATTERN == 0 else "sliding_attention" for i in range(layers)]


class Gemma3(LlamaStyle):
    name = "gemma3"
    title = "Gemma 3 (text)"
    hf_module = "gemma3"
    config_class, model_class = "Gemma3TextConfig", "Gemma3ForCausalLM"
    optional = ("kv_heads", "intermediate", "tied")
    # transformers' apply_rotary_pos_emb, called from Gemma3Attention.forward as a module-level name: routed
    # through each attention module's `rotary` child (graphviz_core.models.hf), so its ops are categorised position.
    rotary = True
    rms_norm = True
    # Not tensor parallel: Llama's column / row pairs would fit q/k/v/o and gate/up/down, but QK-norm's weights then
    # see only their rank's heads and need their gradients all-reduced across the tensor-parallel ranks
    # (transformers' own plan: "replicated_with_grad_allreduce"), which torch's column / row styles do not do; and
    # Gemma 3 1B's single key-value head cannot be split at all.
    parallel = ParallelPlan(
        no_tensor="its QK-norm weights would see only their rank's heads and need their gradients all-reduced across "
        "the tensor-parallel ranks (transformers' plan: replicated_with_grad_allreduce), which the column / row split "
        "does not do; and Gemma 3 1B has one key-value head, which cannot be split",
        stages=DECODER_STAGES,
        ring_attention=True,
        ring_window=SLIDING_WINDOW,  # past it the sliding layers pass a mask, which torch's ring attention refuses
        no_sequence="sequence parallel runs inside tensor parallel, which Gemma 3's QK-norm keeps out (see TP)",
    )
    # The Llama derivation counts two RMSNorms and SwiGLU per layer; Gemma 3 has six norms (four sandwich norms plus
    # QK-norm), each with an extra (1 + weight) add, and GELU-tanh, so that derivation does not describe it.
    layer_memory_formula = None
    hidden_grows = ("the attention and gated-GELU projections grow as hidden × (hidden or intermediate), the six "
                    "RMSNorms, rotary and residual adds as hidden")
    mlp_matmuls = "gated-GELU MLP's three matmuls"

    def head_dim(self, config: ModelConfig) -> int:
        """The head size: the published one at a published width (1152 -> 256), hidden / heads otherwise."""
        return PUBLISHED_HEAD_DIM.get(config.hidden, config.hidden // config.heads)

    def validate(self, config: ModelConfig) -> None:
        # Family's rules (attention choice, hidden divisible by heads), not LlamaStyle's: its even-head-size rule
        # reads hidden / heads, and Gemma's head size may differ (PUBLISHED_HEAD_DIM).
        TransformersFamily.validate(self, config)
        kv = config.kv_heads or config.heads
        if config.heads % kv:
            raise ValueError(
                f"{config.heads} heads are not divisible by {kv} key-value heads; pick key-value heads "
                f"that divide {config.heads} (e.g. {divisor_near(config.heads, kv)})."
            )
        if self.head_dim(config) % 2:
            raise ValueError(
                f"head size {self.head_dim(config)} is odd; rotary embeddings rotate pairs of dimensions, "
                f"so pick hidden and heads giving an even head size."
            )

    def describe(self, config: ModelConfig) -> list[str]:
        parts = super().describe(config)
        if self.head_dim(config) != config.hidden // config.heads:
            parts.append(f"head {self.head_dim(config)}")
        return parts

    def activation_elements(self, config: ModelConfig) -> int:
        """A rough upper estimate of what Gemma 3 keeps for backward, in elements of the model's dtype (admission
        only). Per token per layer: the six RMSNorms keep their input and normalised output in float32 (8h for the
        four sandwich norms, 2 (heads + kv) d for QK-norm; twice as many elements at 16 bits), plus the projections'
        input h, the norm output feeding the MLP h, attention's q, k, v, output and rotary 4 heads d, and the gated MLP
        4 x intermediate (gate, GELU, up, product). Sliding layers past the window keep their s x s mask; eager
        attention keeps its float32 softmax and the probabilities in the model's dtype (2 heads s^2 at float32, 3 at
        16 bits) and the repeated k, v (2 heads d). The logits and their gradients as for any language model.
        TransformersFamily's generic 16h + 3 x intermediate missed the float32 norms: 30% under Gemma 3 1B's
        measured layer in bfloat16."""
        b, s, h = config.batch, config.seq, config.hidden
        d, q, kv = self.head_dim(config), config.heads, config.kv_heads or config.heads
        upcast = 1 if config.dtype == "float32" else 2
        per_token = upcast * (8 * h + 2 * (q + kv) * d) + 2 * h + 4 * q * d + 4 * (config.intermediate or 4 * h)
        if config.attention == "eager":
            per_token += (upcast + 1) * q * s + 2 * q * d
        sliding = layer_types(config.layers).count("sliding_attention") if s >= SLIDING_WINDOW else 0
        return config.layers * b * s * per_token + sliding * b * s * s + 3 * b * s * config.vocab

    def hf_config(self, config: ModelConfig, tf):
        head_dim = self.head_dim(config)
        return tf.Gemma3TextConfig(
            hidden_size=config.hidden,
            intermediate_size=config.intermediate or 4 * config.hidden,
            num_hidden_layers=config.layers,
            num_attention_heads=config.heads,
            num_key_value_heads=config.kv_heads or config.heads,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            vocab_size=config.vocab,
            max_position_embeddings=max(config.seq, MAX_POSITIONS),
            sliding_window=SLIDING_WINDOW,
            layer_types=layer_types(config.layers),
            rope_parameters={kind: {"rope_type": "default", "rope_theta": theta} for kind, theta in ROPE_THETA.items()},
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            attention_bias=False,
            attention_dropout=0.0,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            tie_word_embeddings=config.tied,
            use_cache=False,
            attn_implementation=config.attention,
        )

    presets = (
        Preset(
            "gemma3-tiny",
            "Gemma 3 (text) at toy size: 6 layers, so that the five-sliding-to-one-global pattern appears once "
            "(layer 5 is global), h=64, 4 query heads of 16 / 1 key-value head as in the 1B, gated GELU 256, V=512, "
            "tied embeddings; a real backward on CPU in about a second. The sliding window is Gemma 3 1B's 512 "
            "tokens: raise seq above 512 to see sliding layers attend to fewer tokens than the global one.",
            dict(model="gemma3", hidden=64, intermediate=256, layers=6, heads=4, kv_heads=1, vocab=512, tied=True,
                 batch=2, seq=32),
        ),
        Preset(
            "gemma-3-1b",
            "Gemma 3 1B (text): 26 layers (5 sliding-window layers of 512 tokens to 1 global), h=1152, 4 query "
            "heads of 256 / 1 key-value head, QK-norm, gated GELU 6912, V=262144, tied embeddings "
            "(999,885,952 parameters); s=8192 on meta.",
            on_meta("gemma3", hidden=1152, intermediate=6912, layers=26, heads=4, kv_heads=1, vocab=262144, tied=True,
                    seq=8192),
        ),
    )
    default_fields = presets[0].fields


FAMILIES = (Gemma3(),)
