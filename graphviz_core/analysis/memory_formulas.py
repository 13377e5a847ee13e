"""Activation-memory formulas from the source articles, as pure functions of the config.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Eq. 1), quoted by
"Backprop as a Graph": one transformer layer keeps s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations and dropout. Its
parts: attention 11sbh + 5as²b (QKV input 2sbh, Q and K 4sbh, softmax output 2as²b, its dropout mask as²b and
output 2as²b, V 2sbh, projection input 2sbh, dropout mask sbh), MLP 19sbh (input 2sbh, GELU input 8sbh,
second linear input 8sbh, dropout mask sbh), two LayerNorm inputs 4sbh.
"""

from __future__ import annotations

from graphviz_core.capture.device import BYTES_PER
from graphviz_core.config import ModelConfig


def korthikanti_layer_bytes(config: ModelConfig) -> int:
    """As published, 16-bit activations with dropout: 34sbh, plus 5as²b where attention materialises the
    scores (`manual`); "Backprop as a Graph" quotes 34sbh alone for FlashAttention, which never stores them."""
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


def as_written_34sbh_bytes(config: ModelConfig) -> int:
    """"Backprop as a Graph"'s "34·s·b·h·(bytes/elem)" per layer: Korthikanti's 34sbh is already bytes, so at bf16 this
    counts every activation twice (its Llama-70B example: 80·34·8192·8192·2 ≈ 365 GB)."""
    return 34 * config.seq * config.batch * config.hidden * BYTES_PER[config.dtype]


# The checkpoint policies Korthikanti et al.'s Table 2 has a closed form for (selective-ops has none).
KORTHIKANTI_POLICIES = ("none", "selective-attention", "full")


def korthikanti_policy_layer_bytes(config: ModelConfig, policy: str) -> int:
    """Activation bytes one layer keeps under a checkpoint policy (Korthikanti et al. 2022, Table 2, no tensor
    or sequence parallelism), at the config's dtype: none sbh(34 + 5as/h), the 5as²b only where attention
    materialises the scores (as korthikanti_layer_bytes); selective-attention 34sbh (the attention core is
    recomputed); full 2sbh (the layer's input only). The published numbers are 16-bit bytes; scaled by
    bytes/element / 2."""
    s, b, h = config.seq, config.batch, config.hidden
    per_layer = {"none": korthikanti_layer_bytes(config), "selective-attention": 34 * s * b * h, "full": 2 * s * b * h}
    if policy not in per_layer:
        raise ValueError(f"unknown checkpoint policy {policy!r}; choose one of: {', '.join(per_layer)}.")
    return per_layer[policy] * BYTES_PER[config.dtype] // 2


FP32 = 4  # bytes of the float32 statistics and upcasts, whatever the model's dtype


def llama_layer_bytes(config: ModelConfig, upcast: bool = True, repeat_kv: bool = False) -> int:
    """Bytes one Llama-style layer (llama, mistral, qwen2) saves for backward, derived op by op for transformers'
    implementation with `sdpa` or `eager` attention. e = bytes/element of the dtype, f = 4 (float32), s·b tokens,
    h hidden, a heads, kv·d the key-value width (GQA), I the SwiGLU width.

    RMSNorm as transformers writes it: x.to(float32) -> x.pow(2).mean() -> rsqrt(var + eps) -> x * rstd ->
    weight * that.to(dtype). Saved: the float32 copy of x (f·sbh, kept by Pow and Mul), rstd (f·sb), and the
    normalised x in the dtype (e·sbh, kept by the weight Mul); the next projections keep its output (e·sbh).
    Two norms per layer: 2·((f + 2e)·sbh + f·sb). A fused RMSNorm (`upcast=False`) keeps its e·sbh input and
    f·sb rstd instead of the float32 copy and the normalised x: 2·(2e·sbh + f·sb), i.e. 2·f·sbh less per layer
    (at bf16: 8·sbh of the 48.5·sbh below).

    Attention, fused (`sdpa`): the kernel keeps q (e·sbh), k and v at key-value heads (2e·sb·kv·d; with
    `repeat_kv` at all heads, 2e·sbh), its output (e·sbh, also o_proj's input: one storage) and its float32
    log-sum-exp per head and token (f·a·sb). Rotary: q·cos + rotate_half(q)·sin keeps cos and sin, one table for
    the whole model, not per layer. `eager`: q, k and v repeated to all heads (3e·sbh), the float32 softmax
    (f·a·s²·b) and its copy in the dtype that multiplies v (e·a·s²·b; the same storage at float32), and o_proj's
    input (e·sbh, a transposed copy).

    SwiGLU: down(silu(gate(x)) * up(x)): gate's output for SiLU (e·sbI), SiLU's output and up's output for the
    product (2e·sbI), the product for down (e·sbI) = 4e·sbI.

    Llama 3.1 70B at bf16 (e = 2, kv·d = h/8, I = 3.5h, a = 64, h = 8192), per s·b·h: norms 2·(4 + 4) = 16,
    attention 2 + 0.5 + 2 = 4.5 (+ 4·64/8192 = 0.03 for the log-sum-exp), SwiGLU 8·3.5 = 28: 48.5·sbh bytes
    (40.5 without the upcast), against Korthikanti's 34·sbh for a GPT-style layer with dropout.
    """
    e, f = BYTES_PER[config.dtype], FP32
    s, b, h, a = config.seq, config.batch, config.hidden, config.heads
    kv_width = (config.kv_heads or a) * (h // a)
    inter = config.intermediate or 4 * h
    sb = s * b
    norms = 2 * ((f + 2 * e) * sb * h + f * sb) if upcast else 2 * (2 * e * sb * h + f * sb)
    if config.attention == "eager":
        scores = (f + (e if e != f else 0)) * a * s * s * b
        attention = e * sb * h + 2 * e * sb * h + scores + e * sb * h
    else:
        kv = 2 * e * sb * (h if repeat_kv else kv_width)
        attention = e * sb * h + kv + e * sb * h + f * a * sb
    mlp = 4 * e * sb * inter
    return norms + attention + mlp


def meta_layer_norm_statistics(graph, device: str, dtype: str) -> tuple[int, int]:
    """(LayerNorm nodes, bytes) that a shapes-only run counts beyond what the CPU kernel keeps.

    LayerNorm saves its per-row mean and 1/std for backward. The CPU kernel keeps them in the input's dtype;
    the meta kernel reports float32, as CUDA keeps them. At 16-bit, a meta run therefore counts 2 tensors ×
    rows × (4 − 2) bytes more per LayerNorm than a CPU run of the same config (gpt2-tiny at bf16: 5 LayerNorms
    × 2 × 64 rows × 2 B = 1,280 B). (0, 0) where the runs agree: not meta, not 16-bit, or no LayerNorm.
    """
    if device != "meta" or BYTES_PER.get(dtype, 4) != 2:
        return 0, 0
    nodes = extra = 0
    for _, data in graph.nodes(data=True):
        if data.get("op") != "NativeLayerNormBackward0":
            continue
        stats = [s for s in data.get("saved", ()) if s.get("counted") and not s.get("parameter") and s.get("dtype") == "float32"]
        if stats:
            nodes += 1
            extra += sum(s["bytes"] // 2 for s in stats)  # float32 -> 16-bit halves each statistic
    return nodes, extra


def llama_layer_bytes_split(config: ModelConfig, tp: int = 1, cp: int = 1, sequence_parallel: bool = False) -> dict:
    """llama_layer_bytes (fused `sdpa`, transformers' RMSNorm with its float32 upcast) on one rank of a layout, part
    by part: {"norms", "attention", "mlp", "gathered_inputs", "ring_output_copy"} -> bytes; their sum is the layer.

    Tensor parallel `tp`: attention (q, k, v, output, log-sum-exp) and SwiGLU are split by heads and width, /tp;
    the norms stay whole on every rank ((f + 2e)·sbh + f·sb each, the normalised output kept by the projections).
    Sequence parallel: each norm keeps its input and normalised x for s/tp tokens ((f + e)·sbh/tp + f·sb/tp), and
    the attention's and MLP's column-split projections keep the all-gathered input, e·sbh each, whole: torch's
    matmul saves the tensor it multiplied, where Megatron (Korthikanti et al. 4.2.2) keeps the 1/tp shard and
    gathers it again in backward. Context parallel `cp`: every term at s/cp tokens, plus e·b·(s/cp)·h/tp per layer:
    torch's ring merges the attention output in (batch, heads, sequence, dim) layout, so transformers'
    transpose(1, 2).contiguous() copies it for o_proj, where the CPU kernel's own output is already laid out
    (batch, sequence, heads, dim) and the transpose is free.
    """
    e, f = BYTES_PER[config.dtype], FP32
    s, b, h, a = config.seq // cp, config.batch, config.hidden, config.heads
    kv_width = (config.kv_heads or a) * (h // a)
    inter = config.intermediate or 4 * h
    sb = s * b
    attention = (e * sb * h + 2 * e * sb * kv_width + e * sb * h + f * a * sb) // tp
    parts = {
        "norms": 2 * ((f + 2 * e) * sb * h + f * sb),
        "attention": attention,
        "mlp": 4 * e * sb * inter // tp,
        "gathered_inputs": 0,
        "ring_output_copy": e * sb * h // tp if cp > 1 else 0,
    }
    if sequence_parallel:
        parts["norms"] = 2 * ((f + e) * sb * h + f * sb) // tp
        parts["gathered_inputs"] = 2 * e * sb * h
    return parts


def korthikanti_split_layer_bytes(config: ModelConfig, tp: int = 1, sequence_parallel: bool = False) -> dict:
    """Korthikanti et al. 2022 per layer as published (16-bit activations, dropout, attention scores stored), by
    part, at the config's s, b, h, a: attention 11sbh + 5as²b, MLP 19sbh, two LayerNorm inputs 4sbh. Tensor
    parallel (their Eq. 2) splits all but the attention's and MLP's inputs (2sbh each), their dropout masks (sbh
    each) and the norms' 4sbh: sbh(10 + 24/t + 5as/(ht)); with sequence parallel (Eq. 3) every term is /t:
    sbh/t·(34 + 5as/h). Bytes at 16 bits, as published."""
    s, b, h, a = config.seq, config.batch, config.hidden, config.heads
    sbh = s * b * h
    scores = 5 * a * s * s * b
    if sequence_parallel:
        return {"attention": (11 * sbh + scores) // tp, "mlp": 19 * sbh // tp, "norms": 4 * sbh // tp}
    return {"attention": 3 * sbh + (8 * sbh + scores) // tp, "mlp": 3 * sbh + 16 * sbh // tp, "norms": 4 * sbh}
