"""The two selective checkpointing policies, each meaning the same for every family: `selective-attention`
(Korthikanti et al.'s selective recomputation: re-run the attention core) and `selective-ops` (torchtitan's op-level
selective checkpointing: keep the outputs of compute-heavy ops, re-run the rest). What each keeps and recomputes on
llama-tiny (transformers) and gpt2-tiny (built in), derived; `selective` stays an alias for old links."""

from __future__ import annotations

import pytest

from graphviz_core.config import CHECKPOINTS, FAMILIES, MODELS, config_from_preset
from graphviz_core.models.family import CHECKPOINT_POLICIES
from tests.conftest import captured

# llama-tiny and gpt2-tiny: 2 layers, b=2, s=32, h=64, 4 heads of 16, float32; llama: 2 key-value heads, SwiGLU 128.
B, S, H, NH, D, L = 2, 32, 64, 4, 16, 2
F32 = 4
Q = B * NH * S * D * F32  # (b, nh, s, d) = 16_384 B
KV = B * 2 * S * D * F32  # llama's k or v at 2 key-value heads = 8_192 B
POSITION_IDS = 1 * S * 8  # (1, s) int64, passed to every attention call, one storage = 256 B
CORE_FORWARD = 4 * B * NH * S * S * D  # the fused kernel's q·kᵀ and ·v: 2 x 2·b·nh·s²·d = 524_288 per layer


def test_the_policy_names_mean_the_same_for_every_family():
    assert tuple(CHECKPOINTS) == ("none", "full", "selective-attention", "selective-ops") == tuple(CHECKPOINT_POLICIES)
    for name in MODELS:
        family = FAMILIES[name]
        offered = tuple(family.checkpoint_policies())
        assert set(offered) <= set(CHECKPOINTS)
        # an attention core to recompute: both selective policies; none (an MLP, a ResNet): the op-level one only
        expected = CHECKPOINTS if family.has_attention else ("none", "full", "selective-ops")
        assert offered == tuple(expected), name
        for policy in offered:  # every explanation comes from the policy's own sentence
            assert family.checkpoint_note(policy).startswith(CHECKPOINT_POLICIES[policy].split("{")[0])


def test_selective_is_an_alias_for_what_it_meant_for_each_family():
    # the built-in models always recomputed the attention core; the transformers families kept compute-heavy outputs
    assert config_from_preset("gpt2-tiny", checkpoint="selective").checkpoint == "selective-attention"
    assert config_from_preset("llama-tiny", checkpoint="selective").checkpoint == "selective-ops"
    assert config_from_preset("resnet-tiny", checkpoint="selective").checkpoint == "selective-ops"
    with pytest.raises(ValueError, match="checkpoint 'selective' does not apply to model 'mlp'; choose one of: none, "
                                         "full, selective-ops"):
        config_from_preset("mlp", checkpoint="selective")
    with pytest.raises(ValueError, match="selective-attention recomputes the attention core, and model 'resnet'"):
        config_from_preset("resnet-tiny", checkpoint="selective-attention")


def test_an_old_link_and_the_cli_take_every_name():
    from graphviz_core.cli import main
    from graphviz_core.ui.links import parse_config

    config, problems = parse_config({"preset": "qwen2-tiny", "checkpoint": "selective"})
    assert problems == [] and config.checkpoint == "selective-ops"
    for policy in ("selective", "selective-attention", "selective-ops"):
        assert main(["graph", "--preset", "llama-tiny", "--device", "meta", "--checkpoint", policy, "-o", "/dev/null"]) == 0


def test_selective_attention_keeps_q_k_v_and_reruns_exactly_the_fused_core():
    llama = captured("llama-tiny", checkpoint="selective-attention")
    # each attention's core keeps its inputs: q at 4 heads, k and v at 2 key-value heads, and the position ids
    # (one storage for both layers): 2 * (16_384 + 2 * 8_192) + 256 = 65_792
    assert llama.memory.checkpoint_held_bytes == L * (Q + 2 * KV) + POSITION_IDS == 65_792
    gpt2 = captured("gpt2-tiny", checkpoint="selective-attention")
    assert gpt2.memory.checkpoint_held_bytes == L * 3 * Q == 98_304  # q, k and v at 4 heads
    for capture, core in ((llama, "model.layers.{}.self_attn.core"), (gpt2, "blocks.{}.attn.core")):
        # recomputed: the core's nodes only, the fused kernel (llama's core also reshapes its output: 2 shape ops)
        recomputed = {d["module"] for _, d in capture.graph.nodes(data=True) if d["recomputed"]}
        assert recomputed == {core.format(i) for i in range(L)}
        assert sum(d["category"] == "attention" for _, d in capture.graph.nodes(data=True) if d["recomputed"]) == L
        # the recompute is the core's forward, exactly: 2 layers x 524_288 = 1_048_576 FLOPs
        forward_of_cores = sum(capture.flops.forward_by_module[core.format(i)] for i in range(L))
        assert capture.flops.backward_recompute == forward_of_cores == L * CORE_FORWARD == 1_048_576


def test_spelled_out_cores_rerun_all_but_their_last_matmul():
    # torch's non-reentrant checkpoint stops re-running once the last tensor backward needs is rebuilt: ·v saves
    # its inputs (the probabilities and v) before it computes, so the ·v matmul itself never runs again.
    # q·kᵀ 2·b·nh·s²·d = 262_144, the scale b·nh·s² = 8_192 (softmax and masked_fill count no FLOPs)
    qk, per_score = 2 * B * NH * S * S * D, B * NH * S * S
    gpt2 = captured("gpt2-tiny", attention="manual", checkpoint="selective-attention")
    assert gpt2.flops.backward_recompute == L * (qk + per_score) == 540_672
    # llama eager adds the causal mask to the scores: one more FLOP per score
    llama = captured("llama-tiny", attention="eager", checkpoint="selective-attention")
    assert llama.flops.backward_recompute == L * (qk + 2 * per_score) == 557_056
    # it also holds the additive mask, (b, 1, s, s) float32 = 8_192 B, one storage for both layers
    assert llama.memory.checkpoint_held_bytes == L * (Q + 2 * KV) + POSITION_IDS + B * S * S * F32 == 73_984


def test_selective_ops_keeps_every_matmul_and_attention_kernel_output_and_reruns_the_rest():
    sdpa_out = B * NH * S * D * F32 + B * NH * S * F32  # the fused kernel's output and log-sum-exp = 17_408
    llama = captured("llama-tiny", checkpoint="selective-ops")
    full = captured("llama-tiny", checkpoint="full")
    # per layer: q_proj b·s·h 16_384, k_proj and v_proj b·s·(2·16) 8_192 each, o_proj 16_384, gate and up b·s·128
    # 32_768 each, down 16_384 = 131_072 from its 7 mm, plus the kernel's 17_408 = 148_480; on top of what full holds
    # (each layer's inputs, 37_120)
    kept = 16_384 + 2 * 8_192 + 16_384 + 2 * 32_768 + 16_384
    assert kept == 131_072
    assert llama.memory.checkpoint_held_bytes == L * (kept + sdpa_out) + full.memory.checkpoint_held_bytes == 334_080
    assert llama.memory.saved_bytes == full.memory.saved_bytes  # outside the layers both save the same
    gpt2 = captured("gpt2-tiny", checkpoint="selective-ops")
    # per block: qkv b·s·3h 49_152, attn.proj 16_384, fc b·s·4h 65_536, mlp.proj 16_384 (4 addmm) + 17_408; full
    # holds each block's (b, s, h) input, 16_384
    assert gpt2.memory.checkpoint_held_bytes == L * (49_152 + 16_384 + 65_536 + 16_384 + sdpa_out + 16_384) == 362_496
    # recomputed: everything else in the layer, never a matmul or the kernel (LayerNorms, GELU, rotary, RMSNorms),
    # so the recompute is below even selective-attention's fused kernel
    assert gpt2.flops.backward_recompute < captured("gpt2-tiny", checkpoint="selective-attention").flops.backward_recompute
    assert llama.flops.backward_recompute < full.flops.backward_recompute


def test_every_family_with_attention_runs_both_policies_with_the_same_loss():
    for preset in ("gpt2-tiny", "llama-tiny", "gpt2-hf-tiny", "bert-tiny", "vit-tiny"):
        losses = {captured(preset, checkpoint=p).loss for p in ("none", "selective-attention", "selective-ops")}
        assert len(losses) == 1, preset  # recomputation changes memory, never the numbers
        assert captured(preset, checkpoint="selective-attention").memory.checkpoint_held_bytes > 0
