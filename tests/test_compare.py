"""The diff of two real captures: matching, per-op deltas, per-layer totals and the reasons."""

from graphviz_core.analysis.compare import compare_captures
from graphviz_core.cli import main
from tests.conftest import captured

L = 2  # gpt2-tiny's layers


def test_manual_attention_adds_19_nodes_per_layer_op_by_op():
    c = compare_captures(captured("gpt2-tiny"), captured("gpt2-tiny", attention="manual"))
    # Per layer, manual attention spells out q@kᵀ·scale, mask, softmax, @v:
    #   k.transpose(-2, -1)                        +1 TransposeBackward0
    #   q@kᵀ and p@v on 4-D tensors -> bmm         +2 BmmBackward0
    #   each operand broadcast to 3-D and copied   +4 ExpandBackward0, +4 CloneBackward0
    #   operands/results reshaped 4-D <-> 3-D      +5 UnsafeViewBackward0, +1 ViewBackward0
    #   * 1/sqrt(d), masked_fill, softmax          +1 MulBackward0, +1 MaskedFillBackward0, +1 SoftmaxBackward0
    #   = 20 new nodes, and the fused kernel's one node goes: 20 - 1 = 19
    per_layer = {
        "TransposeBackward0": 1,
        "BmmBackward0": 2,
        "ExpandBackward0": 4,
        "CloneBackward0": 4,
        "UnsafeViewBackward0": 5,
        "ViewBackward0": 1,
        "MulBackward0": 1,
        "MaskedFillBackward0": 1,
        "SoftmaxBackward0": 1,
        "ScaledDotProductFlashAttentionForCpuBackward0": -1,
    }
    assert {d.name: d.delta for d in c.by_op} == {op: L * n for op, n in per_layer.items()}
    assert c.nodes_per_layer_delta == 19 == sum(per_layer.values())
    assert c.headline[0].delta == L * 19
    assert len(c.only_a) == L * 1 and len(c.only_b) == L * 20
    assert "+19 nodes per layer" in c.explanations[0] and "keeps the s×s probabilities" in c.explanations[0]


def test_batch_changes_no_node_only_the_sizes():
    c = compare_captures(captured("gpt2-tiny"), captured("gpt2-tiny", batch=8))
    assert not c.only_a and not c.only_b and c.headline[0].delta == 0
    # every backward FLOP is linear in b (x4 from b=2 to b=8) except the sum of the tied wte/lm_head weight's
    # two gradients, V*h = 512*64 = 32_768 FLOP whatever the batch
    assert c.headline[6].b == 4 * (c.headline[6].a - 32_768) + 32_768
    assert "does not depend on batch" in c.explanations[0]


def test_per_layer_pairs_sum_to_the_totals():
    a, b = captured("gpt2-tiny"), captured("gpt2-tiny", checkpoint="full")
    c = compare_captures(a, b)
    assert sum(p.a_saved_bytes for p in c.per_layer) == a.memory.saved_bytes
    assert sum(p.b_flop for p in c.per_layer) == b.flops.forward + b.flops.backward - b.flops.backward_unattributed
    assert "checkpointing none → full" in c.explanations[0]


def test_cli_compare_prints_the_diff_as_json(capsys):
    import json

    assert main(["compare", "--preset", "gpt2-tiny", "--device", "cpu", "--vs", "--attention", "manual"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["differing_fields"] == {"attention": ["sdpa", "manual"]}
    assert out["nodes_per_layer_delta"] == 19 and len(out["only_b"]) == L * 20


def test_cli_compare_bad_input_is_one_line_exit_2(capsys):
    for argv in (["compare", "--preset", "gpt2-tiny"], ["compare", "--vs", "--heads", "5"], ["compare", "--vs", "--x"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_two_fields_each_claim_only_their_own_share():
    c = compare_captures(captured("gpt2-tiny"), captured("gpt2-tiny", batch=4, layers=3))
    # gpt2-tiny's blocks.0 and blocks.1 have 43 nodes each (101 total = 2*43 + 15 outside the blocks);
    # one more layer adds exactly one block: 144 - 101 = +43 = 1 layer * 43 nodes per layer
    assert c.headline[0].delta == 43
    assert c.explanations[0] == (
        "3 layers instead of 2: +1 layer × 43 nodes per layer = +43 nodes, all of the node difference; "
        "each layer repeats the same ops."
    )
    # batch owns no node (the layer count explained all 43) and no longer contradicts itself
    assert c.explanations[1].startswith(
        "batch 2 → 4: no node added or removed — the graph's shape does not depend on batch"
    )
    assert "+43" not in c.explanations[1] and "×" not in c.explanations[1]
    # the byte and FLOP totals are given once, for both changes together
    assert c.explanations[2].startswith("All 2 changes together: parameters 134,912 → 184,896")
    # parameters: one gpt2-tiny block is 12*h^2 + 13*h = 12*4096 + 832 = 49,984 scalars; A (2 blocks) is wte 512*64 +
    # wpe 32*64 + 2 * 49,984 + ln_f 128 = 134,912, B (3 blocks) 134,912 + 49,984 = 184,896
    assert c.b.summary.parameter_count - c.a.summary.parameter_count == 12 * 64**2 + 13 * 64
    assert len(c.explanations) == 3


def test_a_different_model_is_one_bullet_that_attributes_nothing_to_the_other_fields():
    c = compare_captures(captured("gpt2-tiny"), captured("llama-tiny"))
    # fields that differ: model gpt2 -> llama, kv_heads 0 -> 2, intermediate 0 -> 128 (llama-tiny's _ROPE_TINY)
    assert len(c.explanations) == 1
    (s,) = c.explanations
    delta = c.b.summary.nodes - c.a.summary.nodes
    assert s.startswith(
        f"model gpt2 → llama: a different architecture, so every number differs at once: {delta:+d} nodes"
    )
    assert s.endswith(
        "Also changed: kv_heads 0 → 2, intermediate 0 → 128; these come with the other architecture, and the "
        "totals above are not split among them."
    )
    assert "kv_heads 0 → 2: " not in s  # no per-field claim of the totals


def test_llama_8b_vs_70b_attributes_nodes_to_layers_only_and_speaks_llama():
    c = compare_captures(captured("llama-3.1-8b"), captured("llama-3.1-70b"))
    per_layer = {p.b_nodes for p in c.per_layer if p.layer.startswith("model.layers.")}
    assert per_layer == {81}  # every Llama decoder layer has the same 81 nodes in both
    # 70B - 8B: 80 - 32 = +48 layers; hidden, heads and intermediate only widen the same ops:
    # +48 * 81 = +3888 nodes = the whole difference (2613 -> 6501); both presets are bfloat16, so each loss adds one
    # ToCopy outside the layers (the logits copied to float32, as transformers' ForCausalLMLoss does): 2612 + 1
    assert (c.a.summary.nodes, c.b.summary.nodes) == (2612 + 1, 2612 + 1 + 48 * 81)
    by_field = {s.split(" ")[0]: s for s in c.explanations}
    assert by_field["80"] == (
        "80 layers instead of 32: +48 layers × 81 nodes per layer = +3888 nodes, all of the node difference; "
        "each layer repeats the same ops."
    )
    for field in ("hidden", "heads", "intermediate"):
        assert by_field[field].startswith(f"{field} ") and "no node added or removed" in by_field[field]
        assert "3888" not in by_field[field]
    assert "RMSNorm" in by_field["hidden"] and "SwiGLU" in by_field["intermediate"]
    assert not any("GELU" in s or "LayerNorm" in s for s in c.explanations)
    # 8B: h=4096 / 32 heads = 128; 70B: 8192 / 64 = 128
    assert "head size hidden / heads 128 → 128" in by_field["heads"]
    assert by_field["All"].startswith("All 4 changes together: parameters 8,030,261,248 → 70,553,706,496")


def test_two_fields_that_both_change_the_graph_share_one_node_sentence():
    c = compare_captures(captured("gpt2-tiny"), captured("gpt2-tiny", attention="manual", checkpoint="full"))
    # both attention and checkpointing can add nodes: neither sentence claims a count of its own
    attention, checkpoint, joint, totals = c.explanations
    assert attention.startswith("manual attention instead of sdpa") and "part of the node change below" in attention
    assert checkpoint.startswith("checkpointing none → full: part of the node change below")
    delta = c.headline[0].delta
    # the whole change sits in the layers (L layers, each with the same change): stated per layer and in all
    assert (
        joint.startswith(f"The {delta // L:+d} nodes per layer ({delta:+d} in all) come from")
        and "attention sdpa → manual, checkpoint none → full together" in joint
    )
    assert "layer count" not in joint  # the layer count did not change
    assert totals.startswith("All 2 changes together: ")


def test_per_layer_rows_run_in_forward_order_and_keep_both_models_layers():
    """Llama 3.1 8B (32 layers) against 70B (80 layers) on meta: the rows run as the forward does, as the Memory tab
    lists them (flop_analysis.layers_in_forward_order), not sorted by name (which put '(loss and glue)' and lm_head
    first and model.norm last). 70B's model.layers.32-79 follow the 32 layers both have."""
    c = compare_captures(captured("llama-3.1-8b"), captured("llama-3.1-70b"))
    assert [p.layer for p in c.per_layer] == [
        "model.embed_tokens",
        *(f"model.layers.{i}" for i in range(80)),
        "model.norm",
        "lm_head",
        # forward FLOPs and no node of the graph (the model's own mask bookkeeping, the rotary tables): after the
        # layers backward reaches, before the loss, where the FLOPs tab puts them
        "model",
        "model.rotary_emb",
        "(loss and glue)",
    ]
    # 1 + 80 + 2 + 2 + 1 = 86 rows; each Llama decoder layer has 81 nodes: A has them in layers 0-31 only
    assert [p.a_nodes for p in c.per_layer[1:81]] == [81] * 32 + [0] * 48
    assert [p.b_nodes for p in c.per_layer[1:81]] == [81] * 80


def test_two_architectures_rows_keep_each_forward_order_a_first():
    """gpt2-tiny against llama-tiny share only lm_head and the loss: A's embeddings, blocks and final LayerNorm run
    first, then B's, then the head both have, then B's forward-only rows, the loss last."""
    c = compare_captures(captured("gpt2-tiny"), captured("llama-tiny"))
    rows = [p.layer for p in c.per_layer]
    assert set(rows[:2]) == {"wte", "wpe"}  # token and position embeddings, summed: which backward reaches first
    assert rows[2:] == [
        "blocks.0",
        "blocks.1",
        "ln_f",
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
        "model",
        "model.rotary_emb",
        "(loss and glue)",
    ]
