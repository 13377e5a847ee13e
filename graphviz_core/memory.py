"""Activation-memory formulas from the seeds, as pure functions of the config.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Eq. 1), quoted by
seed 002: one transformer layer keeps s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations and dropout. Its
parts: attention 11sbh + 5as²b (QKV input 2sbh, Q and K 4sbh, softmax output 2as²b, its dropout mask as²b and
output 2as²b, V 2sbh, projection input 2sbh, dropout mask sbh), MLP 19sbh (input 2sbh, GELU input 8sbh,
second linear input 8sbh, dropout mask sbh), two LayerNorm inputs 4sbh.
"""

from __future__ import annotations

from graphviz_core.config import ModelConfig
from graphviz_core.device import BYTES_PER


def korthikanti_layer_bytes(config: ModelConfig) -> int:
    """As published, 16-bit activations with dropout: 34sbh, plus 5as²b where attention materialises the
    scores (`manual`); seed 002 quotes 34sbh alone for FlashAttention, which never stores them."""
    s, b, h, a = config.seq, config.batch, config.hidden, config.heads
    return 34 * s * b * h + (5 * a * s * s * b if config.attention == "manual" else 0)


def layer_bytes_without_dropout(config: ModelConfig) -> int:
    """The same count for this project's blocks, which have no dropout, at the config's dtype.

    Drop the three dropout terms (two sbh masks, the as²b mask and its 2as²b output): 32sbh + 2as²b at 16 bits.
    The 2as²b softmax output is only kept when attention materialises the scores (`manual`); fused kernels
    recompute them. Scaled by bytes per element / 2 for float32.
    """
    s, b, h, a = config.seq, config.batch, config.hidden, config.heads
    scores = 2 * a * s * s * b if config.attention == "manual" else 0
    return (32 * s * b * h + scores) * BYTES_PER[config.dtype] // 2


def seed002_as_written_bytes(config: ModelConfig) -> int:
    """Seed 002's "34·s·b·h·(bytes/elem)" per layer: Korthikanti's 34sbh is already bytes, so at bf16 this
    counts every activation twice (its Llama-70B example: 80·34·8192·8192·2 ≈ 365 GB)."""
    return 34 * config.seq * config.batch * config.hidden * BYTES_PER[config.dtype]


def korthikanti_policy_layer_bytes(config: ModelConfig, policy: str) -> int:
    """Activation bytes one layer keeps under a checkpoint policy (Korthikanti et al. 2022, Table 2, no tensor
    or sequence parallelism), at the config's dtype: none sbh(34 + 5as/h), the 5as²b only where attention
    materialises the scores (as korthikanti_layer_bytes); selective 34sbh (the attention core is recomputed);
    full 2sbh (the layer's input only). The published numbers are 16-bit bytes; scaled by bytes/element / 2."""
    s, b, h = config.seq, config.batch, config.hidden
    per_layer = {"none": korthikanti_layer_bytes(config), "selective": 34 * s * b * h, "full": 2 * s * b * h}
    if policy not in per_layer:
        raise ValueError(f"unknown checkpoint policy {policy!r}; choose one of: {', '.join(per_layer)}.")
    return per_layer[policy] * BYTES_PER[config.dtype] // 2
