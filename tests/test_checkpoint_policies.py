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
    assert tuple(CHECKPOINTS) == ("none", "full", "selective-attention", "selective-ops", "selective-ops-torchtitan") \
        == tuple(CHECKPOINT_POLICIES)
    for name in MODELS:
        family = FAMILIES[name]
        offered = tuple(family.checkpoint_policies())
        assert set(offered) <= set(CHECKPOINTS)
        # an attention core to recompute: both selective policies; none (an MLP, a ResNet): the op-level one only
        expected = CHECKPOINTS if family.has_attention else ("none", "full", "selective-ops", "selective-ops-torchtitan")
        assert offered == tuple(expected), name
        for policy in offered:  # every explanation comes from the policy's own sentence
            assert family.checkpoint_note(policy).startswith(CHECKPOINT_POLICIES[policy].split("{")[0])


def test_selective_is_an_alias_for_what_it_meant_for_each_family():
    # the built-in models always recomputed the attention core; the transformers families kept compute-heavy outputs
    assert config_from_preset("gpt2-tiny", checkpoint="selective").checkpoint == "selective-attention"
    assert config_from_preset("llama-tiny", checkpoint="selective").checkpoint == "selective-ops"
    assert config_from_preset("resnet-tiny", checkpoint="selective").checkpoint == "selective-ops"
    with pytest.raises(ValueError, match="checkpoint 'selective' does not apply to model 'mlp'; choose one of: none, "
                                         "full, selective-ops, selective-ops-torchtitan"):
        config_from_preset("mlp", checkpoint="selective")
    with pytest.raises(ValueError, match="selective-attention recomputes the attention core, and model 'resnet'"):
        config_from_preset("resnet-tiny", checkpoint="selective-attention")


def test_an_old_link_and_the_cli_take_every_name():
    from graphviz_core.cli import main
    from graphviz_core.ui.links import parse_config

    config, problems = parse_config({"preset": "qwen2-tiny", "checkpoint": "selective"})
    assert problems == [] and config.checkpoint == "selective-ops"
    for policy in ("selective", "selective-attention", "selective-ops", "selective-ops-torchtitan"):
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


# selective-ops-torchtitan: torchtitan's `_save_list` and `_get_custom_policy` (pytorch/torchtitan,
# torchtitan/parallelisms/parallelize_llama.py): keep aten.mm outputs except every second mm of each layer run, keep
# the attention kernels' outputs, recompute the rest. llama-tiny's layer runs 7 mm (b·s = 64 rows, float32), in the
# order of LlamaDecoderLayer.forward: q_proj (64, 64), k_proj (64, 32), v_proj (64, 32), [attention], o_proj (64, 64),
# then LlamaMLP's down(act(gate(x)) * up(x)): gate (64, 128), up (64, 128), down (64, 64).
LLAMA_LAYER_MMS = ((B * S, H), (B * S, 2 * D), (B * S, 2 * D), (B * S, H), (B * S, 128), (B * S, 128), (B * S, H))


def _layer_mm_outputs(preset: str) -> tuple[list[tuple[int, ...]], set]:
    """Output shapes of the aten ops layer 0 of `preset` dispatches in one plain (none) forward, in order, seen by a
    dispatch mode: every mm's, and the set of matmul-like op names (to show nn.Linear without a bias is an mm)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphviz_core.models.registry import build_model

    config = config_from_preset(preset)
    model = build_model(config)
    hidden = torch.randn(B, S, H)
    shapes, names = [], set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "mm" in str(func) or "linear" in str(func):
                names.add(str(func))
            if func == torch.ops.aten.mm.default:
                shapes.append(tuple(out.shape))
            return out

    positions = torch.arange(S)[None]
    embeddings = model.model.rotary_emb(hidden, positions)
    with Record():
        model.model.layers[0](hidden, position_embeddings=embeddings, position_ids=positions, attention_mask=None)
    return shapes, names


def test_selective_ops_torchtitan_keeps_the_odd_matmuls_and_the_attention_kernel():
    shapes, names = _layer_mm_outputs("llama-tiny")
    # HF Llama's bias-free nn.Linear on (b, s, h) dispatches to aten.mm on a (b·s, h) view: no addmm, no linear
    assert names == {"aten.mm.default"} and shapes == list(LLAMA_LAYER_MMS)
    # torchtitan's count goes 1, 2, 3...: it keeps the odd ones (q, v, gate, down), recomputes k, o, up
    kept_by_dispatch = sum(rows * cols * F32 for rows, cols in shapes[0::2])
    kept = 16_384 + 8_192 + 32_768 + 16_384  # q b·s·h, v b·s·(2·16), gate b·s·128, down b·s·h = 73_728 per layer
    assert kept_by_dispatch == kept == 73_728
    sdpa_out = B * NH * S * D * F32 + B * NH * S * F32  # the fused kernel's output and log-sum-exp = 17_408
    titan = captured("llama-tiny", checkpoint="selective-ops-torchtitan")
    full, ops = captured("llama-tiny", checkpoint="full"), captured("llama-tiny", checkpoint="selective-ops")
    # on top of what full holds (each layer's inputs, 37_120): 2 x (73_728 + 17_408) = 182_272
    assert titan.memory.checkpoint_held_bytes == L * (kept + sdpa_out) + full.memory.checkpoint_held_bytes == 219_392
    # selective-ops keeps the other 3 too (k b·s·32, o b·s·h, up b·s·128 = 57_344 per layer)
    assert ops.memory.checkpoint_held_bytes - titan.memory.checkpoint_held_bytes == L * (8_192 + 16_384 + 32_768)
    assert titan.memory.saved_bytes == full.memory.saved_bytes  # outside the layers both save the same


def test_selective_ops_torchtitan_reruns_exactly_the_dropped_matmuls_more_than_selective_ops():
    titan = captured("llama-tiny", checkpoint="selective-ops-torchtitan")
    ops = captured("llama-tiny", checkpoint="selective-ops")
    # the dropped mm's forward FLOPs, 2·rows·in·out each: k 2·64·64·32 = 262_144, o 2·64·64·64 = 524_288,
    # up 2·64·64·128 = 1_048_576, per layer
    dropped = L * (262_144 + 524_288 + 1_048_576)
    by_module = titan.flops.forward_by_module
    measured = sum(by_module[f"model.layers.{i}.{m}"] for i in range(L) for m in ("self_attn.k_proj", "self_attn.o_proj",
                                                                                  "mlp.up_proj"))
    assert measured == dropped == 3_670_016
    # both policies re-run the same cheap ops (norms, rotary, SiLU, the SwiGLU product); this one the 3 mm besides
    assert titan.flops.backward_recompute - ops.flops.backward_recompute == dropped
    assert titan.flops.forward == ops.flops.forward  # the forward runs the same ops


def test_selective_ops_torchtitan_keeps_no_matmul_with_a_bias():
    # gpt2-tiny's Linear layers have a bias: aten.addmm, not on torchtitan's list, so each block keeps only the
    # fused kernel's output and log-sum-exp (17_408) besides its (b, s, h) input (16_384)
    gpt2 = captured("gpt2-tiny", checkpoint="selective-ops-torchtitan")
    sdpa_out = B * NH * S * D * F32 + B * NH * S * F32
    assert gpt2.memory.checkpoint_held_bytes == L * (sdpa_out + B * S * H * F32) == 67_584


def test_selective_ops_torchtitan_changes_no_loss_and_no_gradient():
    import torch

    from graphviz_core.models.registry import build_model, compute_loss, make_batch

    grads = {}
    for policy in ("none", "selective-ops-torchtitan"):
        config = config_from_preset("llama-tiny", checkpoint=policy)
        model = build_model(config)
        batch = make_batch(config, "cpu")
        loss = compute_loss(config, model(batch.inputs), batch.targets)
        loss.backward()
        grads[policy] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss_none, none), (loss_titan, titan) = grads["none"], grads["selective-ops-torchtitan"]
    assert torch.equal(loss_none, loss_titan)
    assert none.keys() == titan.keys() and len(none) == 2 * 9 + 3  # 9 tensors a layer, embeddings, norm, lm_head
    # recompute runs the same kernels on the same inputs: the same bits
    assert all(torch.equal(none[name], titan[name]) for name in none)
    for preset in ("gpt2-tiny", "bert-tiny", "resnet-tiny", "mlp"):
        losses = {captured(preset, checkpoint=p).loss for p in ("none", "selective-ops-torchtitan")}
        assert len(losses) == 1, preset


def test_both_op_policies_run_under_tensor_parallel_with_sequence_parallel():
    # under TP the policy sees DTensors: the bytes it keeps are each rank's local shards (read from the op's output),
    # where re-running the op on meta copies of DTensor arguments failed ("out variant should have at least one out
    # arg") and the planner skipped the layout
    from graphviz_core.parallel.planner import Cluster, plan

    # s=256: activations outweigh the 139,584 parameters and the logits at the peak
    result = plan(config_from_preset("llama-tiny", seq=256), Cluster(gpus=2, gpu_memory_bytes=1 << 40, gpus_per_node=2), 2,
                  checkpoints=("full", "selective-ops", "selective-ops-torchtitan"), microbatch_sizes=(1,),
                  pp_degrees=(1,), cp_degrees=(1,), tp_degrees=(2,), jobs=1)
    assert result.skipped == ()
    peaks = {p.layout.checkpoint: p.peak_bytes for p in result.planned}
    assert {p.layout.mesh()["tp"] for p in result.planned} == {2}
    # full keeps each layer's input; torchtitan's policy 4 of the 7 matmul outputs besides; selective-ops all 7
    assert peaks["full"] < peaks["selective-ops-torchtitan"] < peaks["selective-ops"]
