"""Measured numbers next to "Backprop as a Graph"'s and "Backpropagating through GPT-2"'s formulas: every gap is accounted for exactly."""

from graphviz_core.analysis.memory_formulas import (
    as_written_34sbh_bytes,
    korthikanti_layer_bytes,
    layer_bytes_without_dropout,
)
from graphviz_core.analysis.textbook import backward_flops, memory_per_layer
from graphviz_core.config import config_from_preset
from tests.conftest import captured

# gpt2-tiny: b=2, s=32, h=64, a=4 heads, d=16, V=512, 2 layers, float32
b, s, h, a, d, V, L = 2, 32, 64, 4, 16, 512, 2


def rows_by_term(rows):
    return {r.term: r for r in rows}


def test_fused_attention_layer_keeps_32sbh_at_16_bits_plus_small_statistics():
    rows = memory_per_layer(captured("gpt2-tiny"))
    no_dropout = rows_by_term(rows)["Korthikanti without dropout, at this dtype"]
    # 32sbh bytes at 16 bits = 16 elements per token and hidden unit: LN inputs 2, qkv input 1, q/k/v 3,
    # attention output 1, MLP input 1, GELU input 4, second linear input 4. At float32: 16 * 4 * s*b*h.
    assert no_dropout.textbook == 16 * 4 * s * b * h == 262_144
    # The rest: LayerNorm mean and rstd (2 LNs x 2 x b*s x 4 B = 1_024) and the log-sum-exp (b*a*s*4 = 1_024).
    assert no_dropout.measured - no_dropout.textbook == 2 * 2 * b * s * 4 + b * a * s * 4 == 2_048


def test_manual_attention_adds_the_scores_and_the_mask():
    rows = rows_by_term(memory_per_layer(captured("gpt2-tiny", attention="manual")))
    no_dropout = rows["Korthikanti without dropout, at this dtype"]
    # + 2as²b at 16 bits = a*s*s*b float32 probabilities: 4*32*32*2*4 = 32_768
    assert no_dropout.textbook == 262_144 + a * s * s * b * 4 == 294_912
    # remainder: LayerNorm statistics (1_024) and the causal mask (s*s bools = 1_024)
    assert no_dropout.measured - no_dropout.textbook == 1_024 + s * s


def test_seed_002_as_written_doubles_korthikanti_at_16_bits():
    config = config_from_preset("gpt2-blocks-at-llama-70b-width")
    s_, b_, h_ = 8192, 1, 8192
    assert korthikanti_layer_bytes(config) == 34 * s_ * b_ * h_  # fused attention: no s² term
    assert as_written_34sbh_bytes(config) == 2 * korthikanti_layer_bytes(config)
    # "Backprop as a Graph"'s headline: 80 * 34 * 8192 * 1 * 8192 * 2 = 365_072_220_160 bytes ≈ 365 GB
    assert 80 * as_written_34sbh_bytes(config) == 365_072_220_160
    assert layer_bytes_without_dropout(config) == 32 * s_ * b_ * h_


def test_llama_70b_shape_measured_on_meta_is_half_of_seed_002s_claim():
    capture = captured("gpt2-blocks-at-llama-70b-width", layers=2)  # same per-layer tensors as 80 layers; meta either way
    row = rows_by_term(memory_per_layer(capture))["Korthikanti without dropout, at this dtype"]
    # bf16 stores 32sbh bytes per layer = 2_147_483_648; the measured rest is per-token statistics
    # (LayerNorm mean and rstd, the attention log-sum-exp), under 1% here
    assert row.textbook == 2_147_483_648
    assert 0 < row.measured - row.textbook < 0.01 * row.textbook


def test_backward_flops_gap_to_seed_004_is_explained_exactly():
    manual = captured("gpt2-tiny", attention="manual")
    rows = rows_by_term(backward_flops(manual))
    # Every "Backpropagating through GPT-2" term matches its nodes exactly with unfused attention...
    for term in ["qkv_proj + attn_out (12bsh² + 4bsh², per layer)", "attention core: query@key, scaling, softmax, attn@value",
                 "mlp_up + mlp_down (32bsh²)", "gelu (76bsh)", "LayerNorms (11bsh each, 2 per layer + final)", "lm_head (4bshV)"]:
        assert rows[term].measured == rows[term].textbook, term
    # ...and the total differs by exactly the two things "Backpropagating through GPT-2" leaves out: log-softmax 4bsV = 131_072 and
    # the engine's gradient sums where paths meet (residual streams and the tied embedding).
    total = rows["total backward"]
    assert total.measured - total.textbook == 4 * b * s * V + rows["gradient sums where paths meet"].measured
    assert rows["cross-entropy: log-softmax (4bsV)"].measured == 4 * b * s * V == 131_072


def test_fused_attention_differs_from_seed_004_only_by_its_recompute():
    rows = rows_by_term(backward_flops(captured("gpt2-tiny")))
    core = rows["attention core: query@key, scaling, softmax, attn@value"]
    # fused: 10·b·nh·s²·d per layer; "Backpropagating through GPT-2": 8·b·nh·s²·d + 5·b·nh·s²
    assert core.measured == L * 10 * b * a * s * s * d
    assert core.textbook == L * (8 * b * a * s * s * d + 5 * b * a * s * s)


def test_the_gpt2_articles_closed_form_is_the_sum_of_its_terms():
    from graphviz_core.capture.flop_formulas import gpt2_article_backward_terms, gpt2_article_backward_total

    config = config_from_preset("gpt2-small")
    terms = gpt2_article_backward_terms(config)
    # n_L(48bsh² + 8·b·nh·s²·d + 5·b·nh·s² + 98bsh) + 11bsh + 4bshV: every term but cross-entropy's 4bsV
    assert gpt2_article_backward_total(config) == sum(v for k, v in terms.items() if "not in the article's total" not in k)
