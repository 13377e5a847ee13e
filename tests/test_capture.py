"""The capture engine on real models with real backward passes; every exact number has its derivation."""

from collections import Counter

import pytest
import torch

from graphviz_core.capture.engine import capture_backward
from graphviz_core.config import config_from_preset
from tests.conftest import SHARED_CAPTURE, captured, python_threads_spinning


def ops_of(capture, **where):
    return Counter(
        d["op"] for _, d in capture.graph.nodes(data=True) if all(d[k] == v for k, v in where.items())
    )


# ---- "Why Your Transformer Block Has 50 Backward Nodes": the transformer block ----------------------------------------------------------------


def test_transformer_block_has_one_fused_attention_node_and_the_expected_kernels():
    capture = captured("transformer-block")
    cats = capture.summary.by_category
    assert cats["attention"] == 1  # nn.MultiheadAttention(need_weights=False) -> one fused SDPA backward node
    assert ops_of(capture, category="attention") == {"ScaledDotProductFlashAttentionForCpuBackward0": 1}
    assert capture.summary.by_op["NativeLayerNormBackward0"] == 2  # ln_1, ln_2
    assert capture.summary.by_op["GeluBackward0"] == 1
    # The block's two residuals (x + attn, x + mlp). The graph has a third AddBackward0: inside
    # nn.MultiheadAttention the packed in-projection adds its bias separately (mm + add) when batch > 1.
    assert ops_of(capture, op="AddBackward0", module="block") == {"AddBackward0": 2}
    assert ops_of(capture, op="AddBackward0", module="block.attn.mha") == {"AddBackward0": 1}


def test_transformer_block_has_twelve_parameter_tensors_not_nine():
    # "Why Your Transformer Block Has 50 Backward Nodes" says 9 AccumulateGrad nodes; the block has 12 parameter tensors:
    # 2 LayerNorms x (weight, bias) = 4, MHA in_proj (weight, bias) + out_proj (weight, bias) = 4,
    # MLP fc (weight, bias) + proj (weight, bias) = 4.
    capture = captured("transformer-block")
    names = sorted(d["param"]["name"] for _, d in capture.graph.nodes(data=True) if d["op"] == "AccumulateGrad")
    assert names == sorted([
        "block.ln_1.weight", "block.ln_1.bias", "block.ln_2.weight", "block.ln_2.bias",
        "block.attn.mha.in_proj_weight", "block.attn.mha.in_proj_bias",
        "block.attn.mha.out_proj.weight", "block.attn.mha.out_proj.bias",
        "block.mlp.fc.weight", "block.mlp.fc.bias", "block.mlp.proj.weight", "block.mlp.proj.bias",
    ])
    assert capture.summary.parameters == 12
    # 768*2*2 (LNs) + 768*2304 + 2304 (in_proj) + 768*768 + 768 (out_proj) + 768*3072 + 3072 + 3072*768 + 768
    assert capture.summary.parameter_count == 3072 + 1771776 + 590592 + 2362368 + 2360064


def test_graph_size_is_the_same_for_every_batch_and_seq_except_batch_one():
    # "Why Your Transformer Block Has 50 Backward Nodes" claims 50 nodes for batch 1 and 128, seq 64 and 2048. Measured on this build: 57 nodes for
    # batch > 1 at any seq, 55 at batch 1. With batch_first=True, MHA transposes (B, T, C) -> (T, B, C);
    # at B=1 that is still a plain view, so F.linear takes the addmm path (view -> addmm -> view) for the
    # packed in-projection. At B>1 it is strided, so linear becomes matmul: mm + _unsafe_view, a separate
    # bias add, and a clone for .contiguous() before the heads are split.
    sizes = {}
    for batch, seq, device in [(4, 64, "cpu"), (128, 64, "cpu"), (1, 64, "cpu"), (1, 2048, "cpu"), (2, 2048, "cpu"), (128, 2048, "meta")]:
        sizes[batch, seq] = capture_backward(config_from_preset("transformer-block", batch=batch, seq=seq, device=device))
    assert {k: c.summary.nodes for k, c in sizes.items()} == {
        (4, 64): 57, (128, 64): 57, (1, 64): 55, (1, 2048): 55, (2, 2048): 57, (128, 2048): 57}
    batch_one = Counter(sizes[1, 64].summary.by_op)
    batched = Counter(sizes[128, 64].summary.by_op)
    assert dict(batch_one - batched) == {"AddmmBackward0": 1, "ViewBackward0": 2}
    assert dict(batched - batch_one) == {"MmBackward0": 1, "UnsafeViewBackward0": 2, "AddBackward0": 1, "CloneBackward0": 1}
    assert batched == Counter(sizes[2, 2048].summary.by_op)  # seq does not change the graph


def test_manual_attention_is_the_unfused_graph_seed_000_warns_about():
    sdpa = captured("gpt2-tiny", attention="sdpa")
    manual = captured("gpt2-tiny", attention="manual")
    assert manual.summary.by_op["SoftmaxBackward0"] == 2 and manual.summary.by_op["BmmBackward0"] == 4
    # the spelled-out core is attention: per layer q@kᵀ and att@v (2 bmm), scale, mask, softmax = 5 nodes, x 2 layers
    assert manual.summary.by_category["attention"] == 5 * 2
    # Per layer, the fused node is replaced by 20 nodes (19 more): q@kᵀ and att@v are each expand x2 + clone x2 +
    # _unsafe_view x2 (reshape to 3-D) + bmm + _unsafe_view back; plus kᵀ's transpose, the scale (mul),
    # the causal mask (masked_fill), softmax, and the view that matmul adds after the 4-D result.
    per_layer = {"BmmBackward0": 2, "CloneBackward0": 4, "ExpandBackward0": 4, "MaskedFillBackward0": 1,
                 "MulBackward0": 1, "SoftmaxBackward0": 1, "TransposeBackward0": 1, "UnsafeViewBackward0": 5,
                 "ViewBackward0": 1}
    layers = 2
    assert dict(Counter(manual.summary.by_op) - Counter(sdpa.summary.by_op)) == {k: v * layers for k, v in per_layer.items()}
    assert dict(Counter(sdpa.summary.by_op) - Counter(manual.summary.by_op)) == {"ScaledDotProductFlashAttentionForCpuBackward0": layers}
    assert manual.summary.nodes - sdpa.summary.nodes == (sum(per_layer.values()) - 1) * layers == 38  # (20 - 1) * 2


# ---- "Backpropagating through GPT-2": FLOPs ----------------------------------------------------------------------------------

SMALL = dict(layers=2, hidden=64, heads=4, vocab=512, batch=2, seq=32)  # b=2, s=32, h=64, nh=4, d=16, V=512


def test_matmul_backward_flops_equal_seed_004_exactly():
    capture = captured("gpt2-tiny", attention="manual", **SMALL)
    b, s, h, n_h, d, V, n_L = 2, 32, 64, 4, 16, 512, 2
    # "Backpropagating through GPT-2": n_L(48bsh² + 8 b nh s² d) + 4bshV
    #   48*2*32*64² = 12_582_912; 8*2*4*32²*16 = 1_048_576; per layer 13_631_488; x2 = 27_262_976
    #   4*2*32*64*512 = 8_388_608                                      -> total 35_651_584
    expected = n_L * (48 * b * s * h**2 + 8 * b * n_h * s**2 * d) + 4 * b * s * h * V
    assert expected == 35_651_584
    # The projections and the head are matmul; the core's two batched GEMMs (q@kᵀ, att@v) are attention.
    assert capture.flops.backward_by_category["matmul"] == n_L * 48 * b * s * h**2 + 4 * b * s * h * V == 33_554_432
    core_gemms = sum(d_["flops"] for _, d_ in capture.graph.nodes(data=True) if d_["op"] == "BmmBackward0")
    assert core_gemms == n_L * 8 * b * n_h * s**2 * d == 2_097_152
    assert capture.flops.backward_by_category["matmul"] + core_gemms == expected


def test_fused_attention_node_flops_include_the_recomputed_scores():
    capture = captured("gpt2-tiny", attention="sdpa", **SMALL)
    b, s, n_h, d = 2, 32, 4, 16
    # The fused backward recomputes q@kᵀ, then dV = Pᵀ dO, dP = dO Vᵀ, dQ = dS K, dK = dSᵀ Q: 5 batched
    # GEMMs of 2*b*nh*s²*d each = 10*b*nh*s²*d = 10*2*4*32²*16 = 1_310_720 per layer (the unfused graph's
    # q@k and att@v backward nodes do 8*b*nh*s²*d = 1_048_576: the fused kernel pays 2*b*nh*s²*d more).
    per_node = [d_["flops"] for _, d_ in capture.graph.nodes(data=True) if d_["category"] == "attention"]
    assert per_node == [10 * b * n_h * s**2 * d] * 2 == [1_310_720, 1_310_720]


def test_flops_of_a_backward_node_are_what_ran_inside_it():
    capture = captured("mlp", layers=1)
    # MLP b=4, s=8, h=64: fc Linear(64, 256) has input without grad, so its backward does only
    # grad_W = xᵀ @ g: 2 * (b*s) * 64 * 256 = 2 * 32 * 16384 = 1_048_576. proj Linear(256, 64) does
    # grad_in and grad_W: 2 * 2 * 32 * 256 * 64 = 2_097_152. GELU: 19 FLOPs x (4*8*256) = 155_648.
    by_op = {d["op"] + ":" + d["module"]: d["flops"] for _, d in capture.graph.nodes(data=True) if d["flops"]}
    assert by_op == {"AddmmBackward0:layers.0.fc": 1_048_576, "AddmmBackward0:layers.0.proj": 2_097_152,
                     "GeluBackward0:layers.0.act": 155_648}


# ---- memory ---------------------------------------------------------------------------------------------


def test_saved_bytes_of_linear_gelu_linear_match_a_hand_count():
    capture = captured("mlp", layers=1)  # b=4, s=8, h=64, float32; input x has no grad
    saved = {d["op"] + ":" + d["module"]: d["saved_bytes"] for _, d in capture.graph.nodes(data=True) if d["saved_bytes"]}
    bsh = 4 * 8 * 64
    assert saved == {
        "MseLossBackward0:": 2 * bsh * 4,  # the model output and the target: 2 x 8 KiB
        "AddmmBackward0:layers.0.proj": 4 * bsh * 4,  # its input, GELU's output (b*s, 4h): 32 KiB; Wᵀ is a parameter
        "GeluBackward0:layers.0.act": 4 * bsh * 4,  # its input, fc's output (b, s, 4h): 32 KiB
        "AddmmBackward0:layers.0.fc": bsh * 4,  # x (b*s, h) for grad_W; Wᵀ not saved: x needs no grad
    }
    assert capture.memory.saved_bytes == 11 * bsh * 4 == 90_112


def test_manual_attention_saves_more_than_sdpa_tensor_by_tensor():
    sdpa = captured("gpt2-tiny", attention="sdpa", **SMALL)
    manual = captured("gpt2-tiny", attention="manual", **SMALL)
    b, s, h, n_h = 2, 32, 64, 4
    f32 = 4
    # Per layer, sdpa's fused node keeps: q, k, v (views of the one qkv output: b*s*3h*4 = 49_152),
    # its output (b*s*h*4 = 16_384, the same storage proj saves) and the log-sum-exp (b*nh*s*4 = 1_024).
    sdpa_layer = b * s * 3 * h * f32 + b * s * h * f32 + b * n_h * s * f32
    # manual keeps: q, kᵀ, v reshaped to 3-D -- copies, since they are strided views (3 x 16_384 = the
    # same 49_152), the s x s probabilities softmax saves (b*nh*s*s*4 = 32_768; att@v saves the same
    # storage), the causal mask masked_fill saves (s*s bools = 1_024), and the output copy proj saves.
    manual_layer = 3 * b * s * h * f32 + b * n_h * s * s * f32 + s * s * 1 + b * s * h * f32
    assert (sdpa_layer, manual_layer) == (66_560, 99_328)
    assert manual.memory.saved_bytes - sdpa.memory.saved_bytes == 2 * (manual_layer - sdpa_layer) == 65_536

    def saved_shapes(capture, op):
        return sorted((tuple(t["shape"]), t["dtype"]) for _, d in capture.graph.nodes(data=True)
                      if d["op"] == op and d["module"] == "blocks.0.attn.core" for t in d["saved"])

    assert saved_shapes(manual, "SoftmaxBackward0") == [((2, 4, 32, 32), "float32")]
    assert saved_shapes(manual, "MaskedFillBackward0") == [((32, 32), "bool")]
    assert ((2, 4, 32), "float32") in saved_shapes(sdpa, "ScaledDotProductFlashAttentionForCpuBackward0")


def test_checkpointing_moves_memory_from_saved_tensors_to_recompute():
    none = captured("gpt2-tiny")
    full = captured("gpt2-tiny", checkpoint="full")
    selective = captured("gpt2-tiny", checkpoint="selective")
    b, s, h, n_h = 2, 32, 64, 4
    # full: nothing inside a block is saved; each block's input (b*s*h*4 = 16 KiB) is held by the checkpoint.
    assert full.memory.checkpoint_held_bytes == 2 * b * s * h * 4 == 32_768
    assert full.flops.backward_recompute > 0
    # selective: the core attention stops saving the qkv storage (b*s*3h*4 = 49_152) and the
    # log-sum-exp (1_024); the checkpoint holds the qkv storage instead. Its output is still saved by proj.
    assert none.memory.saved_bytes - selective.memory.saved_bytes == 2 * (b * s * 3 * h * 4 + b * n_h * s * 4)
    assert selective.memory.checkpoint_held_bytes == 2 * b * s * 3 * h * 4
    # The recompute is the two forward flash kernels: 4*b*nh*s²*d = 4*2*4*32²*16 = 524_288 each.
    assert selective.flops.backward_recompute == 2 * 4 * b * n_h * s**2 * 16


# ---- meta, determinism, modules, time ----------------------------------------------------------------


def test_meta_counts_the_same_ops_and_flops_as_cpu_for_gpt2_small():
    # s=256, not the preset's 1024: the same ops and kernels (the count of ops does not depend on s), a quarter of the
    # CPU's work (it was the suite's slowest capture)
    cpu = captured("gpt2-small", device="cpu", seq=256)
    meta = captured("gpt2-small", device="meta", seq=256)
    assert meta.summary.by_op == cpu.summary.by_op
    assert meta.summary.by_category == cpu.summary.by_category
    assert meta.flops == cpu.flops
    assert meta.memory.saved_bytes == cpu.memory.saved_bytes
    assert meta.time.forward_s is None and meta.time.backward_s is None
    assert all(d["time_s"] is None and d["grad_norm"] is None for _, d in meta.graph.nodes(data=True))
    assert cpu.summary.parameter_count == 124_439_808  # GPT-2 small, tied embeddings


def test_node_ids_are_deterministic_strings():
    a = capture_backward(config_from_preset("gpt2-tiny"))
    b = capture_backward(config_from_preset("gpt2-tiny"))
    assert list(a.graph.nodes) == list(b.graph.nodes)
    assert list(a.graph.edges) == list(b.graph.edges)
    assert all(isinstance(n, str) and ":" in n for n in a.graph.nodes)


def test_every_node_carries_the_schema():
    capture = captured("gpt2-tiny")
    required = {"op", "category", "module", "saved_bytes", "flops", "time_s", "grad_norm", "param"}
    for _, data in capture.graph.nodes(data=True):
        assert required <= set(data)
        assert data["time_s"] is not None and data["time_s"] >= 0
        assert (data["param"] is not None) == (data["op"] == "AccumulateGrad")
    assert sorted(capture.backward_order) == sorted(capture.graph.nodes)  # every node ran exactly once


def test_modules_are_the_innermost_module_that_created_the_node():
    capture = captured("gpt2-tiny")
    module_of = {d["op"] + "@" + d["module"] for _, d in capture.graph.nodes(data=True)}
    assert "GeluBackward0@blocks.1.mlp.act" in module_of
    assert "ScaledDotProductFlashAttentionForCpuBackward0@blocks.0.attn.core" in module_of
    assert "NllLossBackward0@" in module_of  # the loss is outside the model
    # The residual adds happen in Block.forward, between its children: they belong to the block.
    assert sum(1 for m in module_of if m.startswith("AddBackward0@blocks.0")) == 1
    adds = [d["module"] for _, d in capture.graph.nodes(data=True) if d["op"] == "AddBackward0"]
    assert sorted(adds) == ["", "blocks.0", "blocks.0", "blocks.1", "blocks.1"]  # "" = wte + wpe in GPT2.forward


def test_gradient_norms_match_the_parameter_gradients():
    capture = captured("mlp", layers=1)
    config = capture.config
    from graphviz_core.models.registry import build_model, compute_loss, make_batch

    model = build_model(config)
    batch = make_batch(config, "cpu")
    compute_loss(config, model(batch.inputs), batch.targets).backward()
    for _, d in capture.graph.nodes(data=True):
        if d["op"] == "AccumulateGrad":
            grad = dict(model.named_parameters())[d["param"]["name"]].grad
            assert d["grad_norm"] == pytest.approx(torch.linalg.vector_norm(grad).item(), rel=1e-5)


def test_a_capture_frees_its_model_without_waiting_for_the_cyclic_gc():
    import gc
    import weakref

    import graphviz_core.models.registry as models

    built = []
    original = models.build_model

    def remember(config):
        model = original(config)
        built.append(weakref.ref(model))
        return model

    # Warm-up: the first forward in a process triggers a lazy torch import whose frames importlib keeps,
    # and those frames hold that first model; only later captures show what our own code keeps alive.
    capture_backward(config_from_preset("mlp"))
    gc.disable()
    try:
        import graphviz_core.capture.engine as capture_module

        capture_module.build_model, saved = remember, capture_module.build_model
        try:
            capture_backward(config_from_preset("mlp"))
        finally:
            capture_module.build_model = saved
        assert built and built[0]() is None  # freed by reference counting alone: no cycle holds it
    finally:
        gc.enable()


def test_every_gradient_norm_matches_an_independent_backward():
    """Norms are read once per distinct gradient (a parameter's gradient is sent by one node and received by its
    AccumulateGrad; an add sends one tensor down both paths): every node's figure must still equal the norm of
    all the gradients it sends, computed here from plain hooks on a second, uninstrumented run."""
    import math

    from graphviz_core.capture.walk import autograd_nodes
    from graphviz_core.graph.categories import normalise_op
    from graphviz_core.models.registry import build_model, compute_loss, make_batch

    capture = captured("gpt2-tiny")
    config = capture.config
    model = build_model(config)
    batch = make_batch(config, "cpu")
    loss = compute_loss(config, model(batch.inputs), batch.targets)
    expected = {}
    for i, node in enumerate(autograd_nodes(loss.grad_fn)):
        node_id = f"{normalise_op(node.name())}:{i}"
        leaf = normalise_op(node.name()) == "AccumulateGrad"

        def hook(grad_inputs, grad_outputs, node_id=node_id, leaf=leaf):
            grads = [g for g in (grad_outputs if leaf else grad_inputs) if g is not None]
            expected[node_id] = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads)) if grads else None

        node.register_hook(hook)
    loss.backward()
    assert set(expected) == set(capture.graph.nodes)
    for node_id, d in capture.graph.nodes(data=True):
        if expected[node_id] is None:
            assert d["grad_norm"] is None
        else:
            # The capture reduces in float32 (vector_norm(dtype=float32)), this in float64: the gap is float32
            # rounding of a sum of up to 32,768 squares (wte, 512 x 64), ~sqrt(32,768) x 6e-8 = 1.1e-5 relative for
            # independent rounding errors (AVX2 read 1.1e-6 on AccumulateGrad:13; the order of the sum is the CPU's).
            assert d["grad_norm"] == pytest.approx(expected[node_id], rel=2e-5), node_id


def test_gradient_sums_are_placed_where_the_paths_meet():
    """gpt2-tiny (b=2, s=32, h=64, V=512, 2 layers) with nn.MultiheadAttention: the engine's sums between nodes,
    each one FLOP per element of the gradients added:
    - wte.weight is tied to lm_head: one sum of two V×h gradients = 512·64 = 32,768;
    - the residual stream: each of the 4 residual adds' inputs also feeds a LayerNorm; 3 of those sums land in
      a block's Add, the first in the embedding sum (wte + wpe) at top level, b·s·h = 4,096 each;
    - the packed in-projection: q, k, v are Selects of one (3, b, s, h)-shaped tensor, so their three gradients
      are summed into its Clone: 2 adds of b·s·3h = 12,288 elements = 24,576 per layer, 2 layers."""
    from graphviz_core.analysis.textbook import gradient_sum_places

    capture = captured("gpt2-tiny", attention="mha")
    places = {place: (n, flops) for place, n, flops in gradient_sum_places(capture)}
    b, s, h, V = 2, 32, 64, 512
    assert places["wte.weight: a parameter used in two places (tied weights)"] == (1, V * h)
    assert places["AddBackward0 in blocks.N: residual stream"] == (3, 3 * b * s * h)
    assert places["CloneBackward0 in blocks.N.attn.mha: pieces of one tensor used separately"] == (2, 2 * 2 * b * s * 3 * h)
    assert sum(f for _, f in places.values()) == capture.flops.backward_unattributed


def test_the_first_capture_in_a_process_is_measured_after_the_warm_up():
    # Issue 12 item 8: the process's one-time costs (thread pool start, kernel primitives, first-call caches)
    # were charged to the first capture's forward. In a fresh process, the first capture must find the warm-up
    # already done (it runs before the capture is admitted), and a second warm-up must be free.
    import subprocess
    import sys

    script = (
        "from graphviz_core.capture import engine as c\n"
        "from graphviz_core.config import config_from_preset\n"
        "assert c._WARMED == {}\n"
        "seen = []\n"
        "real = c._Phases.capture\n"
        "c._Phases.capture = lambda self: (seen.append(dict(c._WARMED)), real(self))[1]\n"
        "c.capture_backward(config_from_preset('gpt2-tiny', device='cpu'))\n"
        "print(seen[0].get('cpu', 0) > 0, seen[-1].get('cpu', 0) > 0, len(seen), c.warm_up('cpu'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    # seen[0] is the warm-up's own capture (marked, not yet timed: 0.0), which is also the twin of every gpt2
    # capture with sdpa, float32, no checkpointing; the user's capture sees the time spent
    assert out == ["False", "True", "2", "0.0"], out


def test_the_first_capture_of_a_kind_of_model_comes_after_a_tiny_twin_of_it():
    # A walkthrough's first resnet-tiny capture read forward 2.87 s vs backward 266 ms (3.4 MFLOP): the first
    # convolution kernels were timed. A tiny twin (same family, attention, dtype, checkpointing) runs first,
    # once per process and kind; a second capture of the same kind runs no twin.
    import subprocess
    import sys

    script = (
        "from graphviz_core.capture import engine as c\n"
        "from graphviz_core.config import config_from_preset\n"
        "runs = []\n"
        "real = c._Phases.capture\n"
        "c._Phases.capture = lambda self: (runs.append(self.run.config), real(self))[1]\n"
        "c.capture_backward(config_from_preset('resnet-tiny', device='cpu', batch=3))\n"
        "print(len(runs), runs[1].model, runs[1].batch, runs[2].batch)\n"
        "c.capture_backward(config_from_preset('resnet-tiny', device='cpu', batch=4))\n"
        "print(len(runs))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    # runs: the process warm-up (gpt2), the twin (resnet at resnet-tiny's batch 2), the user's (batch 3); then
    # one more (batch 4) and no second twin
    assert out == ["3", "resnet", "2", "3", "4"], out


def test_meta_at_bf16_differs_from_cpu_only_by_layer_norm_statistics():
    # Issue 12 item 15. gpt2-tiny (2 blocks × 2 LayerNorms + ln_f = 5 LayerNorms; b=2, s=32: 64 rows) at
    # bfloat16: CPU keeps mean and 1/std in bf16, the meta kernel in float32, so meta counts
    # 5 × 2 tensors × 64 rows × (4 − 2) B = 1,280 B more, and nothing else differs.
    from graphviz_core.analysis.memory_formulas import meta_layer_norm_statistics

    cpu = captured("gpt2-tiny", dtype="bfloat16", device="cpu")
    meta = captured("gpt2-tiny", dtype="bfloat16", device="meta")
    assert meta_layer_norm_statistics(meta.graph, meta.device, "bfloat16") == (5, 5 * 2 * 64 * 2)
    assert meta.memory.saved_bytes - cpu.memory.saved_bytes == 1_280
    differ = {n for n, d in cpu.graph.nodes(data=True) if d["saved_bytes"] != meta.graph.nodes[n]["saved_bytes"]}
    assert {cpu.graph.nodes[n]["op"] for n in differ} == {"NativeLayerNormBackward0"} and len(differ) == 5
    # where the runs agree, nothing is claimed: the CPU capture itself, float32 on meta
    assert meta_layer_norm_statistics(cpu.graph, cpu.device, "bfloat16") == (0, 0)
    f32 = captured("gpt2-tiny", device="meta")
    assert meta_layer_norm_statistics(f32.graph, f32.device, "float32") == (0, 0)


def test_time_shared_with_another_python_thread_is_flagged_and_a_quiet_share_is_not():
    import dataclasses

    from graphviz_core.capture.result import DISTURBED_BELOW, TimeSummary

    # 0.3 s of thread CPU over 1.0 s of wall time: 30% < 70%, disturbed; 0.95 over 1.0 is not; meta has no share.
    assert TimeSummary(0.5, 0.5, 0.15, 0.15).cpu_share == pytest.approx(0.3)
    assert TimeSummary(0.5, 0.5, 0.15, 0.15).disturbed and "30%" in TimeSummary(0.5, 0.5, 0.15, 0.15).note()
    assert not TimeSummary(0.5, 0.5, 0.5, 0.45).disturbed and TimeSummary(0.5, 0.5, 0.5, 0.45).note() is None
    assert TimeSummary(None, None).cpu_share is None and not TimeSummary(None, None).disturbed
    # A Python thread spinning beside the capture holds the interpreter lock about half the time, so the capturing
    # thread runs well under DISTURBED_BELOW of its wall time (conftest.python_threads_spinning, SHARED_CAPTURE).
    config = config_from_preset(**SHARED_CAPTURE)
    capture_backward(config)  # a process's first CPU capture warms up first: not beside the spinner
    with python_threads_spinning():
        busy = capture_backward(config)
    assert busy.time.forward_cpu_s is not None and busy.time.cpu_share < DISTURBED_BELOW
    assert busy.time.disturbed
    meta = capture_backward(dataclasses.replace(config_from_preset("gpt2-tiny"), device="meta"))
    assert meta.time.forward_cpu_s is None and not meta.time.disturbed


def test_a_cancel_inside_the_forward_leaves_no_hook_error(recwarn):
    """Cancel lands in a module's pre hook; torch still calls that module's post hook (always_call), which used to pop
    an entry its pre hook had not pushed yet: 'module forward hook with always_call=True raised an exception … pop
    from empty list' in the server's log each time a tab closed mid-forward."""
    from graphviz_core.capture.admission import CaptureCancelled, Ticket

    ticket = Ticket()

    def progress(phase: str) -> None:
        if phase == "running the forward pass":
            ticket.cancel("cancelled by the user")

    with pytest.raises(CaptureCancelled, match="cancelled by the user"):
        capture_backward(config_from_preset("gpt2-tiny", device="cpu"), progress=progress, ticket=ticket)
    assert not [w for w in recwarn if "always_call" in str(w.message)], [str(w.message) for w in recwarn]


@pytest.mark.parametrize("holder", ["a dry run", "context parallel", "a GPU's attention"])
def test_a_dry_run_behind_another_in_this_process_says_what_it_waits_for(holder):
    """A dry run, context parallel's ring and a simulation taking a GPU's attention (where `auto` picks CUDA) all
    replace F.scaled_dot_product_attention while they run, so in one process they take turns; before the worker
    processes were up the compare page showed B 'Waiting for its turn… 3 s' with nothing queued. A dry run behind
    another, or behind such a simulation's step, says what it waits for."""
    import threading

    from graphviz_core.capture.meta_kernels import SDPA_SWAP_LOCK, cuda_attention
    from graphviz_core.parallel.context import cpu_ring_attention

    phases = []
    holders = {"a dry run": lambda: SDPA_SWAP_LOCK, "context parallel": cpu_ring_attention,
               "a GPU's attention": cuda_attention}
    with holders[holder]():
        worker = threading.Thread(target=lambda: capture_backward(config_from_preset("mlp", device="meta"),
                                                                  progress=phases.append))
        worker.start()
        worker.join(timeout=0.5)
        assert worker.is_alive() and phases == [
            "waiting for the dry run or parallel simulation before it (in one process they take turns)"]
    worker.join(timeout=60)
    assert phases[-1] == "annotating the graph"


def test_two_dry_runs_at_once_leave_torchs_attention_in_place():
    """Two dry runs in one process, the second waiting for the first's turn with F.scaled_dot_product_attention: the
    waiting one read the function before its turn (the first's), put it back on leaving, and the first's stayed for
    good (later context-parallel steps then ran without their ring). Once both are done, torch's own is back."""
    import threading

    import torch.nn.functional as F

    from graphviz_core.capture.meta_kernels import SDPA_SWAP_LOCK, fused_attention_on_meta

    torchs = F.scaled_dot_product_attention
    first_in, first_out = threading.Event(), threading.Event()

    def first():
        with fused_attention_on_meta(cuda=False):
            first_in.set()
            first_out.wait(timeout=30)

    def second():
        with fused_attention_on_meta(cuda=False):
            pass

    a = threading.Thread(target=first)
    a.start()
    assert first_in.wait(timeout=30)
    b = threading.Thread(target=second)
    b.start()
    b.join(timeout=0.5)
    assert b.is_alive() and SDPA_SWAP_LOCK.locked()  # the second waits for its turn
    first_out.set()
    a.join(timeout=30)
    b.join(timeout=30)
    assert F.scaled_dot_product_attention is torchs


@pytest.fixture
def auto_picks_cuda(monkeypatch):
    """`auto` resolves to CUDA in the capture engine (a meta dry run then mirrors CUDA's kernels); other names as
    they are."""
    import graphviz_core.capture.engine as engine

    auto = engine.resolve_device
    monkeypatch.setattr(engine, "resolve_device", lambda name: "cuda" if name == "auto" else auto(name))


@pytest.mark.parametrize("preset", ["llama-tiny", "gemma3-tiny"])
def test_a_dry_run_for_a_gpu_draws_grouped_query_attention_as_the_gpu_runs_it(auto_picks_cuda, preset):
    """A float32 dry run where `auto` picks CUDA, of a model whose keys have fewer heads than its queries (llama-tiny
    4/2, gemma3-tiny 4/1; transformers passes enable_gqa). On an H200 (torch 2.11) such attention ran the math path
    (SafeSoftmaxBackward0, the b x heads x s x s weights kept: benchmarks/gpu_sdpa_choice.py), because the
    memory-efficient kernel takes no grouped heads; the dry run named that kernel and llama-tiny's crashed in
    backward ("returned an invalid gradient at index 1 - got [2, 4, 32, 16] but expected [2, 2, 32, 16]") while
    gemma3-tiny's saved 3,264,360 B where the GPU saved 3,602,184. The math path is the same ops on every device,
    so the expected graph is this CPU's under torch's math backend (on the H200 gemma3-tiny's saved 3,602,184 B,
    equal to this CPU's math run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dry = capture_backward(config_from_preset(preset, device="meta"))
    with sdpa_kernel([SDPBackend.MATH]):
        math = capture_backward(config_from_preset(preset, device="cpu"))
    layers = config_from_preset(preset).layers
    assert dry.summary.by_op["SafeSoftmaxBackward0"] == math.summary.by_op["SafeSoftmaxBackward0"] >= layers
    assert not any("Efficient" in op or "ForCpu" in op for op in dry.summary.by_op)
    assert dry.memory.saved_bytes == math.memory.saved_bytes


def test_a_dry_run_for_a_gpu_keeps_the_fused_kernel_where_heads_are_not_grouped(auto_picks_cuda):
    """gpt2-tiny's heads are not grouped: float32 attention on CUDA is the memory-efficient kernel (as on the H200),
    and bfloat16 a fused half-precision kernel (flash named; cuDNN's on an H200, see cuda_attention_kernel)."""
    layers = config_from_preset("gpt2-tiny").layers
    f32 = capture_backward(config_from_preset("gpt2-tiny", device="meta"))
    half = capture_backward(config_from_preset("gpt2-tiny", device="meta", dtype="bfloat16"))
    assert f32.summary.by_op["ScaledDotProductEfficientAttentionBackward0"] == layers
    assert half.summary.by_op["ScaledDotProductFlashAttentionBackward0"] == layers
