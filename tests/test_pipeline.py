"""Pipeline parallelism with torch.distributed.pipelining over the fake process group: every stage's forward and
backward run; how many microbatches a stage holds comes from the schedule's own actions, checked here by a count of
our own, against the textbook rule and against what was live when the memory peaked."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch.distributed as dist

from graphviz_core.config import resolve_config
from graphviz_core.parallel.pipeline import bubble_fraction, simulate_layout, simulate_pipeline, stage_bounds
from graphviz_core.parallel.settings import ParallelConfig, check_parallel

# llama-tiny with 8 layers: h=64, 4 heads of 16, 2 key/value heads, MLP 128, vocabulary 512, seq 32, float32.
# batch 8 split into 8 microbatches of 1.
LLAMA = resolve_config("llama-tiny", layers=8, batch=8)
P, M = 4, 8
# One layer's parameters: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12288, gate, up, down 3 * 64*128 = 24576, two
# RMSNorms 2*64 = 128 -> 36992 scalars = 147968 bytes. The embedding and the head are 512*64 = 32768 each, the final
# norm 64.
LAYER_BYTES = 4 * 36_992
# One microbatch's hidden states (1, 32, 64) float32 = 8192 bytes: what passes between stages, either way.
HIDDEN_BYTES = 1 * 32 * 64 * 4


@pytest.fixture(scope="module")
def gpipe():
    return simulate_pipeline(LLAMA, ParallelConfig("none", P, pp=P, microbatches=M, schedule="gpipe"))


@pytest.fixture(scope="module")
def one_f_one_b():
    return simulate_pipeline(LLAMA, ParallelConfig("none", P, pp=P, microbatches=M, schedule="1f1b"))


def _held_most(actions: list[str], stage: int) -> int:
    """Our own count over the schedule's action list: +1 for each forward of `stage`, -1 for each backward; the
    largest running sum."""
    steps = []
    for action in actions:
        index, kind, _ = re.fullmatch(r"(\d+)([FBI])(\d+)", action).groups()
        if int(index) == stage:
            steps.append(1 if kind == "F" else -1)
    return max(itertools.accumulate(steps))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_microbatches_in_flight_come_from_the_schedules_actions(schedule, gpipe, one_f_one_b):
    report = gpipe if schedule == "gpipe" else one_f_one_b
    assert [s.layers for s in report.per_stage] == [(0, 2), (2, 4), (4, 6), (6, 8)]  # 8 layers / 4 stages
    for stage in report.per_stage:
        actions = list(report.order[stage.rank])
        # Every forward and every backward of the stage is in the schedule's list once: 8 + 8.
        assert sum(a.startswith(f"{stage.stage}F") for a in actions) == M
        assert sum(a.startswith(f"{stage.stage}B") for a in actions) == M
        assert stage.microbatches_in_flight_at_peak == _held_most(actions, stage.stage)
    held = [s.microbatches_in_flight_at_peak for s in report.per_stage]
    # What the run held when each rank's memory peaked (microbatches between the start of their forward and the end
    # of their backward), beside the schedule's count.
    measured = [s.microbatches_held_at_measured_peak for s in report.per_stage]
    if schedule == "gpipe":
        assert held == [M] * P  # all forwards before any backward: every stage holds all 8
        # Stage 0 peaks in its second backward, 7 held: the first backward freed one microbatch's 292352 bytes of
        # activations and made every gradient, 427008 bytes (2 layers and the embedding).
        assert measured == [7, 8, 8, 8]
    else:
        # 1F1B: stage s runs P - s forwards before its first backward, then one forward per backward.
        assert held == [4, 3, 2, 1]
        assert measured == held


def test_1f1b_first_stage_holds_more_than_the_last_and_less_than_gpipe(gpipe, one_f_one_b):
    first, last = one_f_one_b.per_stage[0], one_f_one_b.per_stage[-1]
    assert first.microbatches_in_flight_at_peak > last.microbatches_in_flight_at_peak
    # In bytes too: 4 microbatches of 292352 bytes outweigh the last stage's one of 431752 (its logits and loss).
    assert first.activation_bytes_per_microbatch == 292_352 and last.activation_bytes_per_microbatch == 431_752
    assert first.peak_bytes > last.peak_bytes
    for piped, filled in zip(one_f_one_b.per_stage, gpipe.per_stage, strict=True):
        assert piped.peak_bytes < filled.peak_bytes  # GPipe holds all 8 microbatches everywhere


def test_stages_hold_their_layers_and_send_hidden_states(one_f_one_b):
    stages = one_f_one_b.per_stage
    # 2 layers each; the first adds the embedding (131072 bytes), the last the final norm and the head (131328).
    assert [s.parameter_bytes for s in stages] == [
        2 * LAYER_BYTES + 4 * 32_768,
        2 * LAYER_BYTES,
        2 * LAYER_BYTES,
        2 * LAYER_BYTES + 4 * (64 + 32_768),
    ]
    assert [s.gradient_bytes for s in stages] == [s.parameter_bytes for s in stages]
    # Sent per step: 8 microbatches' hidden states forward (not the last stage) and their gradients back (not the
    # first stage); received likewise.
    assert [s.send_bytes for s in stages] == [M * HIDDEN_BYTES, 2 * M * HIDDEN_BYTES, 2 * M * HIDDEN_BYTES, M * HIDDEN_BYTES]
    assert [s.recv_bytes for s in stages] == [s.send_bytes for s in stages]
    # Each stage's backward does about twice its forward's FLOPs (weights and inputs' gradients).
    for s in stages:
        assert 1.9 < s.backward_flops_per_microbatch / s.forward_flops_per_microbatch < 2.2


def test_bubble_of_equal_stages_is_the_textbook_fraction(gpipe, one_f_one_b):
    # Equal stages, backward twice the forward: GPipe's and 1F1B's bubble is (P - 1) / (M + P - 1) = 3 / 11
    # (Huang et al. 2019; Narayanan et al. 2021), from the schedules' own orders.
    equal = {s: (1.0, 2.0) for s in range(P)}
    assert bubble_fraction(gpipe.order, equal) == pytest.approx(3 / 11)
    assert bubble_fraction(one_f_one_b.order, equal) == pytest.approx(3 / 11)
    # With the measured FLOPs the last stage (head and loss) is slower than the others, and everyone waits on it.
    assert gpipe.bubble_fraction > 3 / 11


def test_pipeline_with_fsdp_shards_each_stage_over_its_ranks():
    # 8 ranks: 4 stages x FSDP over 2. Every parameter's first dimension is even: exactly half per rank.
    report = simulate_pipeline(LLAMA, ParallelConfig("fsdp", 8, pp=P, microbatches=M, schedule="1f1b"), ranks=[0, 3])
    assert [s.parameter_bytes for s in report.per_stage] == [(2 * LAYER_BYTES + 4 * 32_768) // 2,
                                                            (2 * LAYER_BYTES + 4 * (64 + 32_768)) // 2]
    assert [s.microbatches_in_flight_at_peak for s in report.per_stage] == [4, 1]
    first = report.ranks[0]
    assert first.mesh == {"pp": 4, "dp": 2}
    kinds = {c.kind for c in first.collectives}
    assert {"all_gather", "reduce_scatter", "send", "recv"} <= kinds
    assert not dist.is_initialized()


def test_interleaved_ranks_hold_looped_stages():
    # 2 ranks x 2 stages each: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3 (layers 2 each).
    parallel = ParallelConfig("none", 2, pp=2, microbatches=4, schedule="interleaved-1f1b", stages_per_rank=2)
    report = simulate_pipeline(resolve_config("llama-tiny", layers=8, batch=4), parallel)
    assert [(s.stage, s.rank, s.layers) for s in report.per_stage] == [
        (0, 0, (0, 2)), (1, 1, (2, 4)), (2, 0, (4, 6)), (3, 1, (6, 8))]
    for s in report.per_stage:
        assert s.microbatches_in_flight_at_peak == _held_most(list(report.order[s.rank]), s.stage)
    assert report.per_stage[0].peak_bytes == report.per_stage[2].peak_bytes  # one rank, one peak


@pytest.mark.parametrize(("schedule", "per_rank"), [("interleaved-1f1b", 2), ("gpipe", 1)])
def test_data_parallel_wrappers_leave_one_microbatchs_activations_alone(schedule, per_rank):
    # A data-parallel wrapper changes where a stage's parameters live and when they are gathered, not what one
    # microbatch's forward keeps for backward: each data-parallel rank runs the same microbatch (batch 4 / 4) through
    # the same ops on the whole gathered weights, saving the same tensors; the wrapper's own tensors (gathered
    # parameters, all-gather buffers) are filed as gathered parameters and communication buffers. The interleaved
    # schedule gathers each stage itself before its first forward (its UNSHARD actions), outside FSDP's hooks: these
    # gathered parameters once counted as activations and left them negative (stage 0: -126,720 B).
    config = resolve_config("llama-tiny", layers=4, batch=4)  # 4 stages of 1 layer, or 2 of 2 under GPipe

    def run(strategy: str, world: int):
        parallel = ParallelConfig(strategy, world, pp=2, microbatches=4, schedule=schedule, stages_per_rank=per_rank)
        return simulate_pipeline(config, parallel)

    alone = run("none", 2)
    wrapped = {"fsdp": run("fsdp", 4), **({"ddp": run("ddp", 4)} if schedule == "interleaved-1f1b" else {})}
    for report in wrapped.values():
        assert [s.stage for s in report.per_stage] == [s.stage for s in alone.per_stage]
        for stage, plain in zip(report.per_stage, alone.per_stage, strict=True):
            assert stage.activation_bytes_per_microbatch == plain.activation_bytes_per_microbatch > 0
            assert stage.microbatches_in_flight_at_peak == plain.microbatches_in_flight_at_peak  # the same order
            assert stage.microbatches_held_at_measured_peak <= stage.microbatches_in_flight_at_peak
    if "ddp" not in wrapped:
        return
    # DDP (torch's replicate, built on FSDP2) keeps each stage's whole parameters and, gathered from them before the
    # first forward until the step ends, a copy of them: each pipeline rank's peak is the unwrapped one plus its two
    # stages' parameters, counted by the unwrapped run (rank 0: stages 0 and 2, rank 1: stages 1 and 3).
    for stage in wrapped["ddp"].per_stage:
        copies = sum(s.parameter_bytes for s in alone.per_stage if s.rank == stage.rank)
        plain = alone.per_stage[stage.stage]
        assert stage.peak_bytes == plain.peak_bytes + copies
        assert stage.microbatches_held_at_measured_peak == plain.microbatches_held_at_measured_peak


def test_layers_split_as_evenly_as_whole_layers_allow():
    assert stage_bounds(80, 8) == [(i * 10, i * 10 + 10) for i in range(8)]
    assert stage_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]  # 3 + 3 + 2 + 2


@pytest.mark.parametrize(
    ("config", "parallel", "message"),
    [
        (resolve_config("gpt2-tiny"), dict(strategy="none", world_size=2, pp=2, microbatches=2),
         "pipeline parallelism cannot split model .gpt2.: the built-in models take token ids only"),
        (LLAMA, dict(strategy="none", world_size=4, pp=4, microbatches=2), "1F1B needs at least as many microbatches"),
        (LLAMA, dict(strategy="none", world_size=4, pp=4, microbatches=3, schedule="gpipe"),
         "batch 8 is not divisible into 3 microbatches"),
        (LLAMA, dict(strategy="fsdp", world_size=6, pp=4, microbatches=4), "world size 6 is not divisible by pipeline"),
        (resolve_config("llama-tiny", layers=2), dict(strategy="none", world_size=4, pp=4, microbatches=4),
         "4 pipeline stages need at least 4 layers"),
        (LLAMA, dict(strategy="none", world_size=2, pp=2, microbatches=2, stages_per_rank=2),
         "schedule '1f1b' runs one stage per rank"),
    ],
)
def test_layouts_a_pipeline_cannot_take_are_one_sentence(config, parallel, message):
    with pytest.raises(ValueError, match=message):
        check_parallel(config, ParallelConfig(**parallel))


def test_cli_writes_per_stage_and_the_pipeline(tmp_path, capsys):
    from graphviz_core.cli import main

    out = tmp_path / "pp.json"
    argv = ["graph", "--preset", "llama-tiny", "--layers", "4", "--batch", "4", "--device", "meta", "--pp", "2",
            "--microbatches", "4", "--schedule", "gpipe", "-o", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert [s["stage"] for s in data["per_stage"]] == [0, 1]
    first = data["per_stage"][0]
    for key in ("layers", "parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes_per_microbatch",
                "microbatches_in_flight_at_peak", "peak_bytes", "send_bytes", "recv_bytes"):
        assert key in first, key
    assert first["layers"] == 2 and first["microbatches_in_flight_at_peak"] == 4  # GPipe holds all 4
    assert 0 < data["pipeline"]["bubble_fraction"] < 1
    # 4 microbatches of (1, 32, 64) float32 = 8192 bytes each way between the two stages.
    assert data["pipeline"]["send_bytes"] == 2 * 4 * HIDDEN_BYTES
    assert data["per_rank"]["mesh"] == {"pp": 2}
    assert main(["graph", "--preset", "gpt2-tiny", "--pp", "2"]) == 2
    assert capsys.readouterr().err.startswith("graphviz-core: pipeline parallelism cannot split model 'gpt2'")


def test_simulate_layout_without_pipeline_is_the_plain_simulation():
    result = simulate_layout(resolve_config("gpt2-tiny"), ParallelConfig("fsdp", 4), single_device=False)
    assert result.pipeline is None and result.parameter_bytes == 134_912
