"""Beyond one GPU follows the training step's own choices: every rank runs its forward under the config's autocast
and steps the config's optimizer (issue 33, items 1 and 2), in the simulation, the pipeline and the CLI's JSON."""

from __future__ import annotations

import json

import pytest

from graphviz_core.capture.engine import capture_backward
from graphviz_core.cli import main
from graphviz_core.config import resolve_config
from graphviz_core.parallel.pipeline import simulate_layout
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.parallel.simulate import simulate_parallel
from tests.gloo import fsdp_over_gloo

# The walkthrough's config: a 3-layer llama, hidden 96, 2 key/value heads, MLP 128, batch 3, sequence 48. Its 292,512
# parameters: embedding and head 2 x 512 x 96 = 98,304, the final norm 96, and per layer q and o 2 x 96 x 96, k and v
# 2 x 96 x 48 (2 heads of 24), gate, up and down 3 x 96 x 128, two norms 2 x 96 = 64,704, x 3 layers.
LLAMA = resolve_config("llama-tiny", layers=3, hidden=96, kv_heads=2, intermediate=128, batch=3, seq=48, device="cpu")
LLAMA_FLAGS = ["--preset", "llama-tiny", "--layers", "3", "--hidden", "96", "--kv-heads", "2", "--intermediate", "128",
               "--batch", "3", "--seq", "48", "--device", "cpu"]
# gpt2-tiny: 134,912 float32 parameters in 28 tensors (tests/test_parallel.py derives them).
TINY = resolve_config("gpt2-tiny")
TINY_BYTES = 4 * 134_912


def test_every_rank_runs_the_forward_under_autocast_as_the_capture_does():
    """FSDP2 without a MixedPrecisionPolicy adds no dtype copies to the autograd graph, so rank 0's backward graph
    holds exactly the capture's ToCopyBackward0 nodes: autocast's casts plus the model's own conversions. Before the
    fix the simulation ran in float32 under a bfloat16 label: no such node at all."""
    config = LLAMA.replace(autocast="bfloat16")
    captured = capture_backward(config).summary.by_category
    fsdp = ParallelConfig("fsdp", 8)
    under_autocast = simulate_parallel(config, fsdp, single_device=False)
    float32 = simulate_parallel(LLAMA, fsdp, single_device=False)
    assert captured.get("cast", 0) > 0
    assert under_autocast.backward_nodes_by_category["conversion"] == captured["cast"] + captured.get("conversion", 0)
    assert "conversion" not in float32.backward_nodes_by_category  # float32 llama converts nothing
    assert under_autocast.autocast == "bfloat16" and float32.autocast == "none"
    # bfloat16 matmul outputs and attention: the forward's activations shrink, whatever the weights' copies add
    assert under_autocast.phase("forward").parts_bytes["activations"] < float32.phase("forward").parts_bytes["activations"]
    assert under_autocast.peak_bytes != float32.peak_bytes
    # what a step holds between steps does not change: float32 weights (the master copy), gradients and AdamW state
    assert (under_autocast.parameter_bytes, under_autocast.gradient_bytes, under_autocast.optimizer_bytes) == (
        float32.parameter_bytes, float32.gradient_bytes, float32.optimizer_bytes)
    assert any("torch.autocast(bfloat16)" in note for note in under_autocast.notes)


def test_a_real_gloo_run_under_autocast_with_momentum_sgd_matches_the_simulation():
    """Two real processes, real FSDP2, real CPU autocast and a real SGD-with-momentum step: rank 0's forward phase and
    its state match the fake run's. Momentum SGD keeps one buffer shaped like each parameter and no step count: the
    state is the parameter shard's bytes, 539,648 / 2 = 269,824 (AdamW's 2 x 269,824 + 4 x 28 before the fix)."""
    config = TINY.replace(autocast="bfloat16", optimizer="sgd-momentum")
    real = fsdp_over_gloo(config, 2)
    simulated = simulate_parallel(config, ParallelConfig("fsdp", 2), single_device=False)
    assert real.optimizer_bytes == simulated.optimizer_bytes == TINY_BYTES // 2
    assert simulated.expected.optimizer_bytes == TINY_BYTES // 2
    assert real.phase("forward") == simulated.phase("forward")
    assert real.backward_nodes_by_category == simulated.backward_nodes_by_category
    assert simulated.backward_nodes_by_category.get("conversion", 0) > 0  # autocast's casts are on the graph


def test_the_cli_json_per_rank_follows_the_optimizer_and_autocast(tmp_path):
    out = tmp_path / "g.json"

    def per_rank(*flags: str) -> dict:
        assert main(["graph", *LLAMA_FLAGS, "--strategy", "fsdp", "--world-size", "8", *flags, "-o", str(out)]) == 0
        return json.loads(out.read_text())["per_rank"]

    adamw, sgd, momentum = per_rank(), per_rank("--optimizer", "sgd"), per_rank("--optimizer", "sgd-momentum")
    assert (adamw["optimizer"], sgd["optimizer"], momentum["optimizer"]) == ("adamw", "sgd", "sgd-momentum")
    # AdamW: two moments shaped like the shard + a 4-byte step for each of the 30 tensors; SGD: nothing;
    # momentum: one buffer shaped like the shard
    assert adamw["optimizer_bytes"] == 2 * adamw["parameter_bytes"] + 4 * 30
    assert sgd["optimizer_bytes"] == 0 and sgd["expected"]["optimizer_bytes"] == 0
    assert momentum["optimizer_bytes"] == momentum["parameter_bytes"]
    assert "SGD state = nothing" in sgd["expected"]["formula"]
    # the step's phase holds only what the optimizer keeps: the peaks fall with the state
    assert sgd["peak_bytes"] < momentum["peak_bytes"] < adamw["peak_bytes"]
    assert sgd["single_device"]["optimizer_bytes"] == 0
    bf16 = per_rank("--autocast", "bfloat16")
    assert bf16["autocast"] == "bfloat16" and adamw["autocast"] == "none"
    assert bf16["peak_bytes"] != adamw["peak_bytes"]
    assert bf16["backward_nodes_by_category"]["conversion"] > 0


def test_adafactor_keeps_the_state_torch_builds_and_says_what_the_fake_step_skipped():
    result = simulate_parallel(LLAMA.replace(optimizer="adafactor"), ParallelConfig("fsdp", 2), single_device=False)
    assert result.optimizer == "adafactor"
    # torch's Adafactor keeps a step count and factored row / column statistics: less than one shard's bytes,
    # more than the 4-byte step counts alone (the closed form's lower bound)
    assert result.expected.optimizer_bytes == 4 * 30
    assert 4 * 30 < result.optimizer_bytes < result.parameter_bytes
    assert any("Adafactor's update reads a value" in note for note in result.notes)


def test_pipeline_stages_step_the_chosen_optimizer_under_autocast():
    """pp 2 x FSDP 2: every stage's state follows the optimizer (momentum: one buffer per parameter shard, so the
    state equals the stage's parameters), and the stages run autocast (logits leave the head in bfloat16)."""
    parallel = ParallelConfig("fsdp", 4, pp=2, microbatches=3)
    momentum = simulate_layout(LLAMA.replace(optimizer="sgd-momentum"), parallel, single_device=False)
    for stage in momentum.pipeline.per_stage:
        assert stage.optimizer_bytes == stage.parameter_bytes > 0
    assert momentum.optimizer == "sgd-momentum"
    float32 = simulate_layout(LLAMA, parallel, single_device=False)
    bf16 = simulate_layout(LLAMA.replace(autocast="bfloat16"), parallel, single_device=False)
    assert bf16.autocast == "bfloat16"
    head = [s for s in bf16.pipeline.per_stage if s.head][0]
    head32 = [s for s in float32.pipeline.per_stage if s.head][0]
    assert head.activation_bytes_per_microbatch != head32.activation_bytes_per_microbatch


@pytest.mark.parametrize("flags", [[], ["--autocast", "bfloat16"], ["--optimizer", "sgd"]])
def test_one_device_reads_the_same_in_the_simulation_and_the_capture(tmp_path, flags):
    """Issue 33 item 9: one convention everywhere (docs/parallel.md): a peak leaves module buffers out (reported on
    their own as buffer_bytes) and counts the batch with the activations. The capture's step peak is its forward +
    backward peak plus the optimizer's state; the one-device simulation peaks in backward on the same parts, so the
    two are one figure. Before: per_rank.single_device.peak_bytes counted the rotary tables (96 B) and left out the
    batch of the plain MemTracker (ids and targets, 2 x 3 x 48 x 8 = 2,304 B): 6,960,032 against 6,961,088."""
    out = tmp_path / "g.json"
    assert main(["graph", *LLAMA_FLAGS, *flags, "--strategy", "fsdp", "--world-size", "8", "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    per_rank, memory = result["per_rank"], result["memory"]
    alone = per_rank["single_device"]
    assert alone["peak_bytes"] == memory["training_step"]["step_peak_bytes"]
    assert alone["parameter_bytes"] == memory["parameter_bytes"] == 4 * 292_512  # float32, the buffers apart
    assert alone["buffer_bytes"] == per_rank["buffer_bytes"] == memory["buffer_bytes"] > 0
    for phase in per_rank["phases"].values():  # the parts sum to the peak; the buffers are held beside it
        assert sum(v for k, v in phase.items() if k not in ("peak_bytes", "buffers_bytes")) == phase["peak_bytes"]
        assert phase["buffers_bytes"] == per_rank["buffer_bytes"]


def test_torch_compile_is_refused_with_a_sentence_not_shown_as_an_eager_step(capsys):
    """The simulation runs eager steps: a compiled config's per-rank figures would be the eager ones under a compiled
    label, so the CLI refuses it before the capture runs (exit 2, one sentence)."""
    assert main(["graph", *LLAMA_FLAGS, "--compile", "--strategy", "fsdp", "--world-size", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "graphviz-core: the ranks are simulated running the step eagerly (torch.compile is not simulated over the fake "
        "process group); turn torch.compile off to see what each rank holds.")


def test_the_timeline_keeps_every_phase_however_short():
    """The memory timeline is thinned to about 300 points, each window's maximum kept. Windows across the whole step
    once left Adafactor's optimizer phase (a few ops on gpt2-tiny's FSDP rank) one point: the page drew no optimizer
    segment beside a 277 KiB optimizer peak. Windows now stay inside one phase, each phase keeps at least 20 points (or
    all it has), and every peak survives."""
    from graphviz_core.parallel.memory import downsample

    # 3,000 forward and 3,000 backward samples, then 7 of the optimizer's; the step's peak inside the backward
    samples = [("forward", i) for i in range(3000)] + [("backward", 6000 - i) for i in range(3000)] + [
        ("optimizer", 100 + i) for i in range(7)]
    thin = downsample(samples)
    phases = [p for p, _ in thin]
    assert phases.count("optimizer") == 7 and thin[-7:] == tuple(samples[-7:])
    assert phases == sorted(phases, key=["forward", "backward", "optimizer"].index)  # each phase in one piece
    assert max(b for _, b in thin) == 6000
    assert max(b for p, b in thin if p == "forward") == 2999  # each phase's own peak kept
    assert 290 <= len(thin) <= 310

    result = simulate_parallel(resolve_config("gpt2-tiny", optimizer="adafactor"), ParallelConfig("fsdp", 8),
                               single_device=False)
    drawn = [p for p, _ in result.timeline]
    assert drawn.count("optimizer") >= 2  # a segment, not a point
    assert max(b for _, b in result.timeline) == result.peak_bytes
