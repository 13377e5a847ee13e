"""FLOP and time analyses of real gpt2-tiny captures (b=2, s=32, h=64, nh=4, d=16, V=512, L=2)."""

import pytest

from graphviz_core.analysis import flop_analysis as fa
from graphviz_core.analysis.flop_terms import terms_both_ways
from tests.conftest import captured

B, S, H, NH, D, V, L = 2, 32, 64, 4, 16, 512, 2
TOKENS = B * S  # 64


def _family(capture, prefix):
    return next(r for r in fa.ratios_by_family(capture) if r.family.startswith(prefix))


def test_linear_layers_backward_is_exactly_twice_the_forward():
    row = _family(captured("gpt2-tiny"), "linear")
    # per layer 2*tokens*(h*3h + h*h + h*4h + 4h*h) = 2*64*(12288+4096+16384+16384) = 6_291_456; x2 layers
    # + lm_head 2*64*64*512 = 4_194_304 -> 16_777_216
    assert row.forward_flop == 2 * 6_291_456 + 4_194_304 == 16_777_216
    assert row.backward_flop == 2 * 16_777_216 and row.ratio == 2.0


def test_fused_attention_backward_is_2_5x_because_it_recomputes_q_kT():
    row = _family(captured("gpt2-tiny"), "fused attention")
    # forward 2 GEMMs: 4*b*nh*s^2*d = 4*2*4*1024*16 = 524_288 per layer; backward 5 GEMMs: 10*... = 1_310_720
    assert row.forward_flop == L * 4 * B * NH * S * S * D == 1_048_576
    assert row.backward_flop == L * 10 * B * NH * S * S * D == 2_621_440
    assert row.ratio == 2.5


def test_manual_attention_matmuls_are_2x():
    row = _family(captured("gpt2-tiny", attention="manual"), "batched matmul")
    assert row.forward_flop == L * 4 * B * NH * S * S * D  # q@kT and p@v, 2*b*nh*s*s*d each
    assert row.ratio == 2.0


def test_forward_flops_are_attributed_to_modules_and_layers():
    capture = captured("gpt2-tiny")
    f = capture.flops.forward_by_module
    assert f["blocks.0.mlp.fc"] == 2 * TOKENS * H * 4 * H == 2_097_152
    assert sum(f.values()) == capture.flops.forward
    layers = {r.layer: r for r in fa.flops_per_layer(capture)}
    # a block: 6_291_456 linear + 524_288 attention + 2 residual adds of b*s*h = 4096 each
    assert layers["blocks.1"].forward_flop == 6_291_456 + 524_288 + 2 * 4096
    assert sum(r.backward_flop for r in layers.values()) == capture.flops.backward
    assert [r.layer for r in fa.flops_per_layer(capture)][:2] == ["lm_head", "ln_f"]  # nearest the loss first


def test_rule_of_thumb_gap_sums_exactly_to_the_measurement():
    capture = captured("gpt2-tiny")
    rule = fa.rule_of_thumb(capture)
    assert rule.six_n_tokens_flop == 6 * capture.summary.parameter_count * TOKENS
    assert rule.attention_flop == 12 * L * B * S * S * H  # 3_145_728
    assert rule.rule_flop + sum(t.flop for t in rule.gap) == rule.measured_flop
    # parameters without a matmul: wpe 32*64 + 2 LN per layer and ln_f (2*64 each) + biases (3h+h+4h+h per layer)
    # = 2048 + 5*128 + 2*576 = 3840 (wte is tied to lm_head, which multiplies)
    assert rule.gap[0].flop == -6 * 3840 * TOKENS
    # the fused kernel's recompute: 2*b*nh*s^2*d per layer beyond 12*L*b*s^2*h = 2 * 262_144
    assert rule.gap[2].flop == L * 2 * B * NH * S * S * D


def test_node_costs_carry_bytes_moved_and_intensity():
    capture = captured("gpt2-tiny")
    lm_head = next(r for r in fa.node_costs(capture) if r.module == "lm_head" and r.flop)
    # reads dY (b*s, V) = 64x512, writes dX (b*s, h) = 64x64 and dWᵀ (h, V) = 64x512 (fp32, 4 B):
    # (32_768 + 4_096 + 32_768) * 4 = 278_528; reads the saved X 64*64*4 = 16_384 and W 512*64*4 = 131_072
    assert lm_head.bytes_moved == 278_528 + 16_384 + 131_072
    assert lm_head.intensity_flop_per_byte == pytest.approx(8_388_608 / 425_984)
    assert fa.instrumentation_overhead_s(capture) > 0
    top = fa.top_nodes(capture, "flop", 3)
    assert top[0].module == "lm_head" and top[0].flop == 4 * B * S * H * V  # 8_388_608, the largest GEMM pair


def test_meta_has_no_time_but_still_flops():
    capture = captured("gpt2-tiny", device="meta")
    assert fa.instrumentation_overhead_s(capture) is None
    assert all(r.time_s is None and r.flop_per_s is None for r in fa.node_costs(capture))
    assert fa.top_nodes(capture, "time_s") == []
    assert fa.top_nodes(capture, "flop", 1)[0].flop == 8_388_608


def test_gpt2_article_terms_both_ways():
    rows = {r.term: r for r in terms_both_ways(captured("gpt2-tiny"), captured("gpt2-tiny", attention="manual"))}
    qk = rows["2 layers × query@key"]
    assert qk.manual_flop == qk.textbook_flop == L * 4 * B * NH * S * S * D and qk.fused_flop is None
    core = rows["2 layers × attention core, fused"]
    # seed: (8*b*nh*s^2*d + 5*b*nh*s^2) per layer = (1_048_576 + 40_960) * 2; fused measures 10*b*nh*s^2*d
    assert core.textbook_flop == core.manual_flop == 2 * (1_048_576 + 40_960)
    assert core.fused_flop == L * 10 * B * NH * S * S * D
    assert rows["lm_head"].manual_flop == rows["lm_head"].fused_flop == 4 * B * S * H * V


def test_seed004_terms_refuse_mismatched_captures():
    with pytest.raises(ValueError, match="differ only in attention"):
        terms_both_ways(captured("gpt2-tiny"), captured("gpt2-tiny", attention="manual", batch=1))


def test_seed004_terms_accept_a_twin_named_otherwise():
    # The shared cache keys captures without the preset's name and with "auto" resolved, so the FLOP panel's
    # manual-attention twin of gpt2-tiny may come back as an unnamed config on "cpu"; it is the same capture.
    from graphviz_core.capture.engine import capture_backward

    fused = captured("gpt2-tiny")
    twin = capture_backward(fused.config.replace(attention="manual", preset="", device="cpu"))
    assert terms_both_ways(fused, twin)


def test_categories_with_no_flop_formula_are_not_counted_and_no_arithmetic_ones_are_zero():
    # llama-tiny: SiLU (activation) and embedding backward have no formula in torch's flop_counter nor "Backpropagating through GPT-2";
    # RMSNorm is spelled out (pow, mean, rsqrt, mul) so normalization is counted; shape, accumulate_grad and
    # residual_add nodes do no arithmetic and stay 0 without being called uncounted.
    llama = captured("llama-tiny")
    assert fa.uncounted_categories(llama) == ["activation", "embedding"]
    assert {"shape", "accumulate_grad", "residual_add"} <= set(llama.summary.by_category)
    # gpt2-tiny: GELU and LayerNorm have "Backpropagating through GPT-2" formulas; only the embedding lookups are missing
    assert fa.uncounted_categories(captured("gpt2-tiny")) == ["embedding"]
    assert fa.uncounted_categories(captured("resnet-tiny")) == ["activation", "normalization"]  # ReLU, BatchNorm


def test_the_rule_of_thumb_gap_names_the_norm_and_activation_the_family_uses():
    assert fa.rule_of_thumb(captured("llama-tiny")).gap[3].term.startswith("RMSNorm, SiLU, loss and elementwise ops")
    assert fa.rule_of_thumb(captured("gpt2-tiny")).gap[3].term.startswith("LayerNorm, GELU, loss and elementwise ops")


def test_the_summary_table_says_not_counted_where_a_category_has_no_formula():
    from graphviz_core.ui.summary import category_rows

    rows = {r["category"]: r["backward_flops"] for r in category_rows(captured("llama-tiny"))}
    # SiLU backward has no formula: None ("not counted"), not 0; views do no arithmetic: 0
    assert rows["activation"] is None and rows["embedding"] is None and rows["shape"] == 0
    assert rows["normalization"] == captured("llama-tiny").flops.backward_by_category["normalization"] > 0


def test_layer_of_splits_hugging_face_paths_per_layer_and_keeps_embeddings_norm_and_head_apart():
    cases = {
        "model.layers.12.self_attn.q_proj": "model.layers.12",  # Llama, Mistral, Qwen, Mixtral
        "model.embed_tokens": "model.embed_tokens",
        "model.norm": "model.norm",
        "lm_head": "lm_head",
        "transformer.h.3.mlp.c_fc": "transformer.h.3",  # GPT-2 (HF)
        "transformer.wte": "transformer.wte",
        "bert.encoder.layer.0.attention.self.query": "bert.encoder.layer.0",
        "vit.encoder.layer.1.output.dense": "vit.encoder.layer.1",
        "resnet.encoder.stages.2.layers.1.layer.0.convolution": "resnet.encoder.stages.2",
        "resnet.embedder.embedder.convolution": "resnet.embedder",
        "blocks.1.attn.qkv": "blocks.1",  # the built-in GPT-2
        "": "(loss and glue)",
    }
    assert {m: fa.layer_of(m) for m in cases} == cases


def test_saved_bytes_per_layer_run_in_forward_order_with_the_flops_tabs_layers():
    from graphviz_core.analysis.memory_breakdown import saved_bytes_by_layer

    llama = captured("llama-tiny")
    by_layer = saved_bytes_by_layer(llama)
    assert list(by_layer) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head",
                              "(loss and glue)"]
    assert sum(by_layer.values()) == llama.memory.saved_bytes
    # the same grouping as the FLOPs tab (which has no embedding row: a lookup has no FLOP formula)
    assert set(by_layer) - {"model.embed_tokens"} <= {r.layer for r in fa.flops_per_layer(llama)}
    # the FLOPs tab runs the other way, nearest the loss first; "model" (its own ops outside the layers: position and
    # mask bookkeeping, 32 FLOPs) and "model.rotary_emb"
    # (cos/sin tables) only have forward FLOPs, no node: after the layers, before the loss and the gradient sums
    assert [r.layer for r in fa.flops_per_layer(llama)] == [
        "lm_head", "model.norm", "model.layers.1", "model.layers.0", "model", "model.rotary_emb", "(loss and glue)",
        "(gradient sums between nodes)"]
    gpt2 = saved_bytes_by_layer(captured("gpt2-tiny"))
    assert list(gpt2) == ["wpe", "wte", "blocks.0", "blocks.1", "ln_f", "lm_head", "(loss and glue)"]
    # wte's lookup saves its indices, b*s = 64 int64 = 512 B; wpe's, s = 32 positions int64 = 256 B
    assert (gpt2["wte"], gpt2["wpe"]) == (512, 256)


def test_the_rule_of_thumb_says_when_it_does_not_apply():
    # a convolution reuses each weight at every pixel: 6 FLOPs per parameter per token says nothing there
    assert fa.rule_of_thumb(captured("resnet-tiny")).not_applicable.startswith("6·N·tokens does not apply")
    assert fa.rule_of_thumb(captured("gpt2-tiny")).not_applicable is None


def test_a_mixture_of_experts_takes_out_its_idle_experts_and_counts_its_expert_matmuls_apart_from_attention():
    """mixtral-tiny: h=64, I=128, 4 experts, 2 per token, L=2, b=2, s=32 (64 tokens), fused attention.

    Expert weights per layer, stacked: gate_up (4, 2·128, 64) = 65,536 + down (4, 64, 128) = 32,768 = 98,304; two
    layers 196,608, of which (4 − 2)/4 = 98,304 see no given token. The experts run as grouped matmuls over the 64 × 2
    routed rows: forward 2 · 64 tokens · 2 · (128·64·2 + 64·128) = 6,291,456 per layer, backward twice that (input
    and weight gradients),
    so 3 × 6,291,456 × 2 layers = 37,748,736 = 6 × 98,304 active × 64 tokens: the experts' row is exactly 0, and
    the idle row is −6 × 98,304 × 64 = −37,748,736. The attention row is the same as llama-tiny's (same attention),
    and no expert matmul is counted as attention."""
    capture = captured("mixtral-tiny")
    experts = fa.experts_of(capture)
    assert (experts.count, experts.per_token, experts.parameters, experts.idle_parameters) == (4, 2, 196_608, 98_304)
    assert experts.flop == 3 * (2 * 64 * 2 * (128 * 64 * 2 + 64 * 128)) * 2 == 37_748_736
    rule = fa.rule_of_thumb(capture)
    idle = next(t for t in rule.gap if "expert parameters see no given token" in t.term)
    assert idle.flop == -6 * 98_304 * 64
    assert next(t for t in rule.gap if t.term.startswith("the experts' matmuls")).flop == 0
    no_matmul = next(t for t in rule.gap if "do no matrix multiply" in t.term)
    # 512 × 64 embedding + 5 RMSNorm gains of 64 (2 per layer + the final one) = 33,088; lm_head is untied (a matmul)
    assert no_matmul.term.startswith("33,088 of the 287,552 parameters") and no_matmul.flop == -6 * 33_088 * 64
    attention = next(t for t in rule.gap if t.term.startswith("attention measured"))
    assert attention.flop == next(t for t in fa.rule_of_thumb(captured("llama-tiny")).gap
                                  if t.term.startswith("attention measured")).flop
    assert rule.rule_flop + sum(t.flop for t in rule.gap) == rule.measured_flop  # still exact
    assert rule.experts == experts
    assert fa.experts_of(captured("llama-tiny")) is None


def test_families_whose_forward_has_no_flop_formula_have_no_forward_and_the_overall_ratio_leaves_them_out():
    capture = captured("gpt2-tiny")
    rows = {r.family: r for r in fa.ratios_by_family(capture)}
    # backward by the textbook's per-element formulas; the forward ops (gelu, layer_norm, log_softmax) have none
    assert rows["GELU"].backward_flop == 19 * L * B * S * 4 * H == 622_592
    assert rows["LayerNorm"].backward_flop == 11 * (2 * L + 1) * B * S * H == 225_280  # 2 per block + ln_f
    assert rows["log-softmax (loss)"].backward_flop == 4 * B * S * V == 131_072
    for family in ("GELU", "LayerNorm", "log-softmax (loss)"):
        assert (rows[family].forward_flop, rows[family].ratio) == (None, None), family  # not counted, not 0
    # counted both ways: the forward's adds, 4 residual + token/position = 5 × b·s·h = 20_480
    assert rows["elementwise (add, sub, mul, div)"].forward_flop == 5 * B * S * H == 20_480
    overall = fa.overall_ratio(capture)
    assert overall.left_out_families == ("GELU", "LayerNorm", "log-softmax (loss)")
    assert overall.left_out_backward_flop == 622_592 + 225_280 + 131_072 == 978_944
    assert overall.forward_flop == 16_777_216 + 1_048_576 + 20_480 == 17_846_272  # linear + fused attention + adds
    # backward: linear 2 × 16_777_216; fused attention 10·b·nh·s²·d × L = 2_621_440; the engine's gradient sums,
    # 4 residual branch points × b·s·h + the tied wte/lm_head weight's second gradient V·h = 16_384 + 32_768
    assert overall.backward_flop == 2 * 16_777_216 + 2_621_440 + 4 * B * S * H + V * H == 36_225_024
    assert overall.ratio == 36_225_024 / 17_846_272  # 2.03, where every counted backward over it read 2.08
    assert overall.all_ops_ratio == (36_225_024 + 978_944) / 17_846_272
    # llama-tiny: RMSNorm is spelled out (counted both ways), SiLU counts nothing either way: only the loss is left out
    assert fa.overall_ratio(captured("llama-tiny")).left_out_families == ("log-softmax (loss)",)


def test_a_node_whose_ops_have_no_flop_formula_is_not_counted_and_one_with_no_arithmetic_is_zero():
    assert fa.flop_counted("matmul", "MmBackward0", 8_388_608)
    assert not fa.flop_counted("embedding", "EmbeddingBackward0", 0)  # a scatter-add, no formula
    assert not fa.flop_counted("activation", "SiluBackward0", 0)
    assert fa.flop_counted("shape", "ViewBackward0", 0)  # no arithmetic: a true 0
    assert fa.flop_counted("embedding", "AddBackward0", 0)  # wte + wpe: hands the same gradient to both inputs
    costs = fa.node_costs(captured("gpt2-tiny"))
    assert {r.op for r in costs if r.flop is None} == {"EmbeddingBackward0", "NllLossBackward0"}
    assert {r.flop for r in costs if r.category in fa.NO_ARITHMETIC} == {0}
    # a node not counted never ranks among the top nodes by FLOPs
    assert all(r.flop for r in fa.top_nodes(captured("gpt2-tiny"), "flop", 50))
