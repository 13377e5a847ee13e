"""The checkpoint comparison against torch.utils.checkpoint applied by hand, and will-it-fit against
captures at the answer and one past it."""

import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from graphviz_core.analysis.checkpointing import compare_checkpointing
from graphviz_core.analysis.fit import _largest, largest_fitting
from graphviz_core.analysis.training_step import training_step_of
from graphviz_core.capture.engine import capture_backward
from graphviz_core.config import ModelConfig, config_from_preset
from graphviz_core.models.registry import build_model, compute_loss, make_batch

MLP = dict(model="mlp", hidden=64, layers=3, batch=4, seq=8)


def _by_hand(config: ModelConfig, checkpointed: bool) -> tuple[int, int]:
    """Saved + held bytes (storages alive after the forward that are neither parameters, batch nor the
    loss) and backward FLOPs, for the MLP's layers run through torch.utils.checkpoint in a plain loop."""
    model = build_model(config.replace(checkpoint="none"))
    batch = make_batch(config, "cpu")
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    x = batch.inputs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in model.layers:
            x = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        loss = compute_loss(config, x, batch.targets)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return sum(v for k, v in saved.items() if k not in params), flops.get_total_flops()


def test_full_checkpointing_table_matches_checkpoint_applied_by_hand():
    config = ModelConfig(**MLP, device="cpu")
    table = compare_checkpointing(config, device="cpu")
    none, full = table.row("none"), table.row("full")
    hand_none, flops_none = _by_hand(config, checkpointed=False)
    hand_full, flops_full = _by_hand(config, checkpointed=True)
    # Outside the checkpoints the hook sees the saves of checkpoint's own input saver (each layer's input,
    # 4*8*64*4 = 8_192 B, the first being the batch input) and the loss's two inputs.
    assert full.kept_for_backward_bytes == hand_full
    assert none.kept_for_backward_bytes == hand_none
    # none: per layer input 8_192 + GELU input 4*8*256*4 = 32_768 + second linear input 32_768 = 73_728,
    # x 3 layers = 221_184, plus the output/target the MSE loss saves (8_192 + 8_192) = 237_568
    assert none.saved_bytes == 3 * (8_192 + 32_768 + 32_768) + 2 * 8_192 == 237_568
    # full: every layer holds only its input (3 x 8_192) and the loss still saves its two: 40_960
    assert full.kept_for_backward_bytes == 3 * 8_192 + 2 * 8_192 == 40_960
    # The recompute is the extra backward work by hand (flop_counter counts only matmuls: the recomputed
    # first linear of each layer, 2*32*64*256 = 1_048_576 FLOPs; the second linear is never re-run: early stop).
    assert flops_full - flops_none == 3 * 2 * 32 * 64 * 256
    assert full.recompute_flops >= flops_full - flops_none
    assert full.recompute_flops < full.forward_flops


def test_selective_on_gpt2_counts_what_it_holds_and_mha_also_recomputes_the_in_projection():
    sdpa = compare_checkpointing(config_from_preset("gpt2-tiny"))
    mha = compare_checkpointing(config_from_preset("gpt2-tiny", attention="mha"))
    for table in (sdpa, mha):
        none, selective = table.row("none"), table.row("selective-attention")
        assert selective.kept_for_backward_bytes == selective.saved_bytes + selective.held_bytes
        assert selective.held_bytes > 0 and selective.kept_for_backward_bytes <= none.kept_for_backward_bytes
    # sdpa: each block's core holds q, k and v, 3 x (2*4*32*16*4 = 16_384) = 49_152 B, 2 blocks
    assert sdpa.row("selective-attention").held_bytes == 2 * 3 * 2 * 4 * 32 * 16 * 4
    assert mha.row("selective-attention").recompute_flops > sdpa.row("selective-attention").recompute_flops


def test_largest_fitting_batch_is_the_edge_where_a_full_depth_capture_stops_fitting():
    # 5 layers: probes run at 2 and 3 layers and are extrapolated, then checked at 5.
    config = ModelConfig(model="gpt2", hidden=64, heads=4, layers=5, vocab=512, batch=2, seq=32, device="meta")

    def step_peak(batch: int) -> int:
        return training_step_of(capture_backward(config.replace(batch=batch))).step_peak_bytes

    budget = step_peak(7) + 1  # batch 7 fits by one byte; larger batches need more
    result = largest_fitting(config, budget, "none", "batch")
    assert result.largest == 7 and result.largest_step_peak_bytes == budget - 1
    assert step_peak(8) > budget
    assert not result.weights_alone_exceed and result.predicted_largest >= 1


def test_nothing_fits_when_weights_and_optimizer_state_alone_exceed_the_budget():
    config = config_from_preset("gpt2-tiny")
    # 134_912 parameters x 16 B (fp32 weights 4 + grads 4 + Adam 8) = 2_158_592 B > 2 MiB
    result = largest_fitting(config, 2 * 2**20, "full", "batch", parameter_count=134_912)
    assert result.largest == 0 and result.weights_alone_exceed and result.captures == 0


def test_bisection_finds_the_edge_from_any_guess():
    for answer in (0, 1, 2, 37, 1000):
        for guess in (None, 1, 36, 38, 999, 5000):
            assert _largest(lambda n, edge=answer: n <= edge, 1, 5000, guess) == answer


def test_cli_memory_checkpoints_json_is_the_comparison_and_bad_budget_is_one_line(tmp_path, capsys):
    import json

    from graphviz_core.cli import main

    out = tmp_path / "memory.json"
    assert main(["memory", "--preset", "gpt2-tiny", "--checkpoints", "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    table = compare_checkpointing(config_from_preset("gpt2-tiny"))
    assert [r["policy"] for r in report["checkpoints"]["rows"]] == ["none", "full", "selective-attention", "selective-ops",
                                                                     "selective-ops-torchtitan"]
    for row, expected in zip(report["checkpoints"]["rows"], table.rows, strict=True):
        assert row["kept_for_backward_bytes"] == expected.kept_for_backward_bytes
        assert row["recompute_flops"] == expected.recompute_flops
    assert report["peak_bytes"] == report["timeline"]["peak_bytes"]
    assert main(["memory", "--preset", "gpt2-tiny", "--budget-gib", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("graphviz-core: --budget-gib takes a memory budget from 0.01 to "
                                               "1,000,000 GiB, got 0.")
