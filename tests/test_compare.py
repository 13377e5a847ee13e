"""The diff of two real captures: matching, per-op deltas, per-layer totals and the reasons."""

from graphviz_core.cli import main
from graphviz_core.compare import compare_captures
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
