"""The built-in teaching models as families: an MLP, one transformer block, and a GPT-2-style stack.

The modules themselves are in graphviz_core.models.teaching (imported when a model is built, so that validating a
config imports no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphviz_core.models.family import Batch, Family, ParallelPlan, Preset

if TYPE_CHECKING:
    from graphviz_core.config import ModelConfig

_TEACHING = ("sdpa", "mha", "manual")


class _BuiltIn(Family):
    attentions = _TEACHING
    hidden_grows = "matmuls grow as hidden², GELU and LayerNorm as hidden"
    spelled_out_attention = "manual"
    # Megatron's pairs in the teaching block: q, k, v in one column-split qkv and the MLP's first matmul fc; the
    # attention's output and the MLP's second matmul (both named proj) row-split.
    parallel = ParallelPlan(
        tensor=(("qkv", "colwise"), ("fc", "colwise"), ("proj", "rowwise")),
        no_stages="the built-in models take token ids only, where a later pipeline stage is handed hidden states; the "
        "pipeline cuts the Hugging Face decoders",
        no_ring="the built-in GPT-2 numbers its learned positions itself (0 to s - 1), where context parallel hands "
        "each rank the positions of its own chunks; the ring runs on the Hugging Face decoders",
        no_sequence="sequence parallel here ends the sequence shard at a transformers decoder's final norm and head "
        "(get_decoder, get_output_embeddings), which the built-in models do not have",
    )
    selective_alias = "selective-attention"  # what `selective` meant here: the attention core, as Korthikanti et al.
    module_class = ""  # the nn.Module in graphviz_core.models.teaching
    # The teaching attention computes q, k and v in one nn.Linear: an adapter there adapts all three at once.
    lora_targets = ("qkv",)
    lora_targets_note = "the fused query/key/value projection qkv: one adapter spans q, k and v"

    def validate_finetuning(self, config: ModelConfig) -> None:
        super().validate_finetuning(config)
        if config.finetune == "lora" and not config.lora_targets and config.attention == "mha" and self.has_attention:
            raise ValueError("with attention 'mha' the projections are packed inside nn.MultiheadAttention, which LoRA's "
                             "default targets cannot reach; choose attention sdpa or manual, or name other layers "
                             "with lora_targets (e.g. fc).")

    def checkpoint_note(self, policy: str, config: ModelConfig | None = None) -> str:
        note = super().checkpoint_note(policy, config)
        if policy == "selective-attention" and config is not None and config.attention == "mha":
            # nn.MultiheadAttention has no core apart from its projections: the whole call is re-run
            note += "; with nn.MultiheadAttention the whole call is re-run, its packed in-projection too"
        return note

    def build(self, config: ModelConfig):
        from graphviz_core.models import teaching

        return teaching.build(getattr(teaching, self.module_class), config)

    def batch(self, config: ModelConfig, device) -> Batch:
        from graphviz_core.models import teaching

        return teaching.random_batch(config, device, tokens=self.language_model)

    def loss(self, config: ModelConfig, output, targets):
        from graphviz_core.models import teaching

        return teaching.loss(output, targets, cross_entropy=self.language_model)

    def _mlp_parameters(self, config: ModelConfig) -> int:
        h = config.hidden
        return 8 * h * h + 5 * h  # fc (h x 4h + 4h) + proj (4h x h + h)

    def _block_parameters(self, config: ModelConfig) -> int:
        h = config.hidden
        return 4 * h * h + 4 * h + self._mlp_parameters(config) + 4 * h  # qkv + proj, their biases, MLP, two LayerNorms

    def activation_elements(self, config: ModelConfig) -> float:
        """Korthikanti et al. (2022): about 34·s·b·h bytes per layer at 2 bytes/element (17 elements per token per
        hidden unit), plus 5·a·s²·b bytes (2.5 elements) where attention materialises the s x s scores (`manual`),
        plus logits and their gradients."""
        b, s, h, a = config.batch, config.seq, config.hidden, config.heads
        per_layer = 17 * s * b * h + (2.5 * a * s * s * b if config.attention == "manual" else 0)
        logits = 3 * b * s * config.vocab if self.language_model else 0
        return config.layers * per_layer + logits


class MLPFamily(_BuiltIn):
    name = "mlp"
    title = "MLP (built in)"
    lacks = ("heads", "vocab", "attention")
    attentions = ("sdpa",)
    spelled_out_attention = None
    module_class = "MLP"
    hidden_grows = Family.hidden_grows
    has_attention = False
    lora_targets = ("fc", "proj")
    lora_targets_note = "both linear layers of every block (an MLP has no attention)"
    selective_alias = None  # `selective` always meant the attention core, which an MLP has not
    language_model = False
    parallel = ParallelPlan(
        tensor=(("fc", "colwise"), ("proj", "rowwise")), split_heads=False,
        no_stages="an MLP has no token embedding or head for the first and last stages to hold",
        no_ring="an MLP has no attention and no sequence to split",
        no_sequence="an MLP has no token sequence to shard",
    )
    presets = (
        Preset(
            "mlp",
            "Linear -> GELU -> Linear, twice, with an MSE loss: the smallest graph worth reading.",
            dict(model="mlp", hidden=64, layers=2, batch=4, seq=8),
        ),
    )
    default_fields = presets[0].fields

    def parameter_count(self, config: ModelConfig) -> int:
        return config.layers * self._mlp_parameters(config)

    def activation_elements(self, config: ModelConfig) -> float:
        return config.layers * 10 * config.seq * config.batch * config.hidden

    def training_flops(self, config: ModelConfig) -> int:
        return int(6 * self.parameter_count(config) * config.batch * config.seq)


class BlockFamily(_BuiltIn):
    name = "block"
    title = "one transformer block (built in)"
    lacks = ("vocab",)
    module_class = "BlockModel"
    language_model = False
    stacked_layers = False
    shardable = False
    parallel = ParallelPlan(
        no_tensor="one block has no repeated layers: parallel layouts are simulated on models of many (gpt2, mlp)",
        no_stages="one block has no layers to cut between stages",
        no_ring="one block has no token positions to split (it reads a hidden-state batch)",
        no_sequence="one block has no layers between which to keep the sequence sharded",
    )
    layer_memory_formula = "korthikanti"
    presets = (
        Preset(
            "transformer-block",
            "One pre-LN transformer block as in the textbook: h=768, 12 heads, nn.MultiheadAttention, 4h GELU MLP, "
            "two residuals.",
            dict(model="block", hidden=768, heads=12, layers=1, batch=4, seq=128, attention="mha"),
        ),
    )
    renamed_presets = (("seed-block", "transformer-block"),)  # its former name, for old links and scripts
    default_fields = dict(model="block", hidden=64, heads=4, layers=1, batch=2, seq=32)

    def validate(self, config: ModelConfig) -> None:
        super().validate(config)
        if config.layers != 1:
            raise ValueError(f"model 'block' is exactly one transformer block; layers must be 1, got {config.layers}.")

    def parameter_count(self, config: ModelConfig) -> int:
        return self._block_parameters(config)


class GPT2Family(_BuiltIn):
    name = "gpt2"
    title = "GPT-2 (built in)"
    optional = ("context",)
    module_class = "GPT2"
    layer_memory_formula = "korthikanti"
    gpt2_backward_terms = True
    presets = (
        Preset(
            "gpt2-tiny",
            "GPT-2 architecture at toy size (2 layers, h=64, 4 heads, V=512): captures in well under a second.",
            dict(model="gpt2", hidden=64, heads=4, layers=2, vocab=512, batch=2, seq=32),
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
            dict(model="gpt2", hidden=8192, heads=64, layers=80, vocab=128256, batch=1, seq=8192, context=8192,
                 dtype="bfloat16", device="meta"),
        ),
    )
    default_fields = presets[0].fields

    def parameter_count(self, config: ModelConfig) -> int:
        h = config.hidden
        # wte (tied lm_head), wpe, blocks, ln_f
        return config.vocab * h + config.positions * h + config.layers * self._block_parameters(config) + 2 * h


FAMILIES = (MLPFamily(), BlockFamily(), GPT2Family())
