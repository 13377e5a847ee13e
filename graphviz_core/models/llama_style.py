"""Llama-style decoder families from `transformers`: Llama, Mistral, Qwen2.5 and Mixtral (RMSNorm, rotary positions,
grouped-query attention, SwiGLU; Mixtral routes each token to some of its SwiGLU experts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphviz_core.models.family import DECODER_STAGES, LLAMA_TENSOR, ParallelPlan, Preset
from graphviz_core.models.transformers_family import TransformersFamily

if TYPE_CHECKING:
    from graphviz_core.config import ModelConfig

ROPE_TINY = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512)


def tiny(model: str, what: str, **fields) -> Preset:
    """A family's `<family>-tiny` preset: a real backward on CPU in about a second."""
    return Preset(
        f"{model}-tiny",
        f"{what} at toy size: a real backward on CPU in about a second.",
        dict(model=model, batch=2, seq=32, **fields),
    )


def on_meta(model: str, **fields) -> dict:
    """Published sizes: shapes-only dry run at bfloat16 on meta (the weights alone would not fit here)."""
    return dict(model=model, batch=1, dtype="bfloat16", device="meta", **fields)


def divisor_near(n: int, k: int) -> int:
    """The divisor of `n` closest to `k` (a suggestion in an error message)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - k))


class LlamaStyle(TransformersFamily):
    """A Llama-style decoder; the subclasses differ in their config class and presets."""

    optional = ("kv_heads", "intermediate", "tied")
    rotary = True
    rms_norm = True
    # Attention through transformers' SDPA path: torch's context_parallel swaps the kernel for its ring.
    parallel = ParallelPlan(tensor=LLAMA_TENSOR, stages=DECODER_STAGES, ring_attention=True, sequence=True)
    hidden_grows = ("the attention and SwiGLU projections grow as hidden × (hidden or intermediate), RMSNorm, rotary "
                    "and residual adds as hidden")
    mlp_matmuls = "SwiGLU MLP's three matmuls"
    layer_memory_formula = "llama"
    config_extra: dict = {}

    def validate(self, config: ModelConfig) -> None:
        super().validate(config)
        kv = config.kv_heads or config.heads
        if config.heads % kv:
            raise ValueError(
                f"{config.heads} heads are not divisible by {kv} key-value heads; pick key-value heads "
                f"that divide {config.heads} (e.g. {divisor_near(config.heads, kv)})."
            )
        if (config.hidden // config.heads) % 2:
            raise ValueError(
                f"head size {config.hidden // config.heads} (hidden / heads) is odd; rotary embeddings rotate "
                f"pairs of dimensions, so pick hidden and heads giving an even head size."
            )

    def decoder_kwargs(self, config: ModelConfig) -> dict:
        """The fields every Llama-style `transformers` config shares."""
        return dict(
            hidden_size=config.hidden,
            intermediate_size=config.intermediate or 4 * config.hidden,
            num_hidden_layers=config.layers,
            num_attention_heads=config.heads,
            num_key_value_heads=config.kv_heads or config.heads,
            vocab_size=config.vocab,
            max_position_embeddings=max(config.seq, 8192),
            attention_dropout=0.0,
            tie_word_embeddings=config.tied,
            use_cache=False,
            attn_implementation=config.attention,
        )

    def hf_config(self, config: ModelConfig, tf):
        return getattr(tf, self.config_class)(**self.config_extra, **self.decoder_kwargs(config))


_LLAMA_70B = dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=128256, seq=8192)


class Llama(LlamaStyle):
    name = "llama"
    title = "Llama"
    hf_module = "llama"
    config_class, model_class = "LlamaConfig", "LlamaForCausalLM"
    config_extra = dict(rope_theta=500000.0)
    presets = (
        tiny("llama", "Llama (RMSNorm, rotary positions, grouped-query attention, SwiGLU)", **ROPE_TINY),
        Preset(
            "llama-3.2-1b",
            "Llama 3.2 1B: 16 layers, h=2048, 32 query / 8 key-value heads, SwiGLU 8192, "
            "V=128256, tied embeddings (1.24B parameters); s=8192 on meta.",
            on_meta("llama", hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256, tied=True,
                    seq=8192),
        ),
        Preset(
            "llama-3.1-8b",
            "Llama 3.1 8B: 32 layers, h=4096, 32 query / 8 key-value heads, SwiGLU 14336, "
            "V=128256 (8.03B parameters); s=8192 on meta.",
            on_meta("llama", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256, seq=8192),
        ),
        Preset(
            "llama-3.1-70b",
            "Llama 3.1 70B: 80 layers, h=8192, 64 query / 8 key-value heads, SwiGLU 28672, "
            "V=128256 (70.6B parameters); s=8192 on meta.",
            on_meta("llama", **_LLAMA_70B),
        ),
        Preset(
            "llama-3.1-405b",
            "Llama 3.1 405B: 126 layers, h=16384, 128 query / 8 key-value heads, SwiGLU 53248, "
            "V=128256 (406B parameters); s=8192 on meta.",
            on_meta("llama", hidden=16384, intermediate=53248, layers=126, heads=128, kv_heads=8, vocab=128256,
                    seq=8192),
        ),
    )
    # llama-3.1-70b's former name (the same config), still accepted by --preset and old links
    renamed_presets = (("llama-70b-shape", "llama-3.1-70b"),)
    default_fields = presets[0].fields


class Mistral(LlamaStyle):
    name = "mistral"
    title = "Mistral"
    hf_module = "mistral"
    config_class, model_class = "MistralConfig", "MistralForCausalLM"
    config_extra = dict(sliding_window=None)
    presets = (
        tiny("mistral", "Mistral (Llama-style layers, no sliding window)", **ROPE_TINY),
        Preset(
            "mistral-7b",
            "Mistral 7B v0.3: 32 layers, h=4096, 32 query / 8 key-value heads, SwiGLU 14336, V=32768 "
            "(7.25B parameters); s=4096 on meta.",
            on_meta("mistral", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=32768, seq=4096),
        ),
    )
    default_fields = presets[0].fields


class Qwen2(LlamaStyle):
    name = "qwen2"
    title = "Qwen2.5"
    hf_module = "qwen2"
    config_class, model_class = "Qwen2Config", "Qwen2ForCausalLM"
    config_extra = dict(use_sliding_window=False)
    presets = (
        tiny("qwen2", "Qwen2.5 (Llama-style layers with q/k/v biases)", **ROPE_TINY),
        Preset(
            "qwen2.5-7b",
            "Qwen2.5 7B: 28 layers, h=3584, 28 query / 4 key-value heads, SwiGLU 18944, V=152064, "
            "biases on q/k/v (7.62B parameters); s=4096 on meta.",
            on_meta("qwen2", hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064, seq=4096),
        ),
    )
    default_fields = presets[0].fields


class Mixtral(LlamaStyle):
    name = "mixtral"
    title = "Mixtral (mixture of experts)"
    optional = ("kv_heads", "intermediate", "tied", "experts", "experts_per_token")
    hf_module = "mixtral"
    config_class, model_class = "MixtralConfig", "MixtralForCausalLM"
    layer_memory_formula = None  # the Llama derivation has no experts
    parallel = ParallelPlan(
        tensor=LLAMA_TENSOR, stages=DECODER_STAGES, ring_attention=True,
        no_sequence="its experts stay whole on every tensor-parallel rank, so on a sequence shard each rank's experts "
        "would see its own tokens only and their gradients would need an all-reduce the column / row split does not "
        "issue",
    )
    presets = (
        tiny("mixtral", "Mixtral (mixture of experts: 4 experts, each token routed to 2)", **ROPE_TINY, experts=4,
             experts_per_token=2),
        Preset(
            "mixtral-8x7b",
            "Mixtral 8x7B: 32 layers, h=4096, 32 query / 8 key-value heads, 8 SwiGLU experts of "
            "14336, 2 per token, V=32000 (46.7B parameters, 12.9B active); s=4096 on meta.",
            on_meta("mixtral", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=32000,
                    experts=8, experts_per_token=2, seq=4096),
        ),
    )
    default_fields = presets[0].fields

    def validate(self, config: ModelConfig) -> None:
        super().validate(config)
        if not config.experts or not config.experts_per_token:
            raise ValueError("model 'mixtral' needs experts and experts_per_token (Mixtral 8x7B: 8 and 2).")
        if config.experts_per_token > config.experts:
            raise ValueError(
                f"experts_per_token {config.experts_per_token} is more than the {config.experts} experts; "
                f"lower it to at most {config.experts}."
            )

    def hf_config(self, config: ModelConfig, tf):
        return tf.MixtralConfig(
            num_local_experts=config.experts,
            num_experts_per_tok=config.experts_per_token,
            router_jitter_noise=0.0,
            output_router_logits=False,
            experts_implementation=_experts_implementation(),
            **self.decoder_kwargs(config),
        )

    def active_parameter_count(self, config: ModelConfig) -> int:
        """Parameters a token's step uses: the experts it is not routed to left out."""
        h, inter = config.hidden, config.intermediate or 4 * config.hidden
        idle = (config.experts - config.experts_per_token) * config.layers * 3 * h * inter
        return self.parameter_count(config) - idle

    def training_flops(self, config: ModelConfig) -> int:
        """6 per active parameter per token, plus attention's 12·b·s²·h per layer."""
        s = config.tokens
        return 6 * self.active_parameter_count(config) * config.batch * s + 12 * config.layers * config.batch * s * s * config.hidden


def _experts_implementation() -> str:
    """Mixtral's experts as training runs them: the grouped matmul (tokens sorted by expert, one GEMM per expert's
    rows, `torch._grouped_mm`), which saves each token's activations for backward and keeps the weights as they are.
    It runs on CPU (any dtype, torch 2.9 on) and on meta, so the graph is the same on both.

    Where this torch has no `_grouped_mm`, the batched-matmul form: each token's k expert weight matrices gathered,
    then one bmm. It too runs everywhere, but autograd keeps the gathered copies: tokens × k × an expert's weights
    (Mixtral-8x7B at s=4096: 2.7 TiB per layer, against 1.5 GiB with the grouped matmul). `transformers`' default
    loop selects tokens with `nonzero()`, which meta cannot run."""
    import torch

    return "grouped_mm" if hasattr(torch, "_grouped_mm") else "batched_mm"


FAMILIES = (Llama(), Mistral(), Qwen2(), Mixtral())
