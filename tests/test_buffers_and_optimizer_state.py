"""Buffers are not parameters, and one rule for the optimizer's state: module buffers (a ResNet's BatchNorm running
statistics) are reported on their own in the capture, its JSON and the per-rank simulation; the optimizer's state
counted by the training step and by the simulation is what a real torch optimizer holds after one step."""

from __future__ import annotations

import json

import pytest
import torch

from graphviz_core.analysis.training_step import training_step_of
from graphviz_core.config import config_from_preset
from graphviz_core.export.formats import capture_to_dict
from graphviz_core.models.registry import build_model, compute_loss, make_batch
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.parallel.simulate import simulate_parallel
from tests.conftest import captured

# resnet-tiny: ResNet-18's layout (basic blocks 2-2-2-2) at stem width 8, stage widths 8, 16, 32, 64. Its
# BatchNorms: the stem's one (8 channels); stage 1 two blocks x two (8 each; no shortcut: 8 -> 8 at stride 1);
# stages 2-4 two blocks x two plus the first block's shortcut, five each (16, 32, 64 channels).
BATCHNORM_CHANNELS = [8] + [8] * 4 + [16] * 5 + [32] * 5 + [64] * 5  # 20 BatchNorms, 600 channels
# Each keeps running_mean and running_var (float32 per channel) and num_batches_tracked (one int64).
RESNET_TINY_BUFFER_BYTES = sum(2 * 4 * c for c in BATCHNORM_CHANNELS) + 8 * len(BATCHNORM_CHANNELS)


def test_resnet_tiny_buffers_are_its_batchnorm_statistics_derived_from_the_layout():
    assert len(BATCHNORM_CHANNELS) == 20 and sum(BATCHNORM_CHANNELS) == 600
    # 600 channels x 2 statistics x 4 B = 4_800, plus 20 counters x 8 B = 160
    assert RESNET_TINY_BUFFER_BYTES == 600 * 2 * 4 + 20 * 8 == 4_960
    capture = captured("resnet-tiny")
    assert capture.memory.buffer_bytes == RESNET_TINY_BUFFER_BYTES
    # parameters stay parameters: 4 B per scalar, no buffer among them
    assert capture.memory.parameter_bytes == 4 * capture.summary.parameter_count
    memory = json.loads(json.dumps(capture_to_dict(capture)))["memory"]
    assert memory["buffer_bytes"] == 4_960
    assert memory["parameter_bytes"] == 4 * capture.summary.parameter_count


def test_gpt2_tiny_has_no_buffers():
    assert captured("gpt2-tiny").memory.buffer_bytes == 0  # the causal mask is built in forward, not registered


def test_ddp_rank_holds_every_parameter_and_reports_the_buffers_beside_them():
    result = simulate_parallel(config_from_preset("resnet-tiny"), ParallelConfig("ddp", 4))
    # DDP: every rank holds every parameter whole (4 B each) and the BatchNorm statistics whole
    assert result.parameter_bytes == 4 * result.parameter_count == result.expected.parameter_bytes
    assert result.buffer_bytes == RESNET_TINY_BUFFER_BYTES
    assert result.single_device.buffer_bytes == RESNET_TINY_BUFFER_BYTES
    per_rank = result.to_dict()
    assert per_rank["parameter_bytes"] == 4 * result.parameter_count
    assert per_rank["buffer_bytes"] == per_rank["single_device"]["buffer_bytes"] == 4_960
    for phase in per_rank["phases"].values():
        # each phase's parts sum to its peak; the buffers are held beside it, as the capture's peaks leave them out
        assert phase["buffers_bytes"] == 4_960
        assert sum(v for k, v in phase.items() if k not in ("peak_bytes", "buffers_bytes")) == phase["peak_bytes"]


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
}


def _state_bytes_after_one_step(preset: str, optimizer: str) -> int:
    """Bytes of every tensor in a real torch optimizer's state after one step on the preset's model."""
    config = config_from_preset(preset, device="cpu")
    model = build_model(config)
    batch = make_batch(config, "cpu")
    opt = OPTIMIZERS[optimizer](model.parameters())
    compute_loss(config, model(batch.inputs), batch.targets).backward()
    opt.step()
    return sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_training_step_optimizer_state_is_a_real_optimizers_state_after_one_step(optimizer):
    capture = captured("gpt2-tiny")
    step = training_step_of(capture, optimizer)
    # gpt2-tiny: 134_912 float32 parameters in 28 tensors (wte, wpe, ln_f weight + bias, 12 per block x 2)
    assert (step.parameter_count, step.parameter_tensors) == (134_912, 28)
    # AdamW / Adam: exp_avg + exp_avg_sq (2 x 4 B per parameter) + a float32 `step` per tensor (4 B x 28)
    # = 1_079_296 + 112 = 1_079_408; SGD with momentum: one buffer, 4 x 134_912 = 539_648; SGD: nothing
    expected = {"adamw": 1_079_408, "adam": 1_079_408, "sgd-momentum": 539_648, "sgd": 0}[optimizer]
    assert step.optimizer_state_bytes == expected == _state_bytes_after_one_step("gpt2-tiny", optimizer)


def test_the_simulation_and_the_training_step_count_adamw_state_by_one_rule():
    config = config_from_preset("gpt2-tiny")
    one_device = simulate_parallel(config, ParallelConfig(), single_device=False)
    step = training_step_of(captured("gpt2-tiny"))
    # one float32 device: the simulation's AdamW state (measured by torch's memory tracker) = the training step's
    assert one_device.optimizer_bytes == step.optimizer_state_bytes == 2 * 4 * 134_912 + 4 * 28
    assert one_device.expected.optimizer_bytes == one_device.optimizer_bytes


def test_the_optimizer_state_note_names_what_it_counts():
    from graphviz_core.analysis.training_step import optimizer_state_note

    assert optimizer_state_note("adamw", 28) == "two fp32 moments (8 B) per parameter + a 4 B step count for each of 28 tensors"
    assert optimizer_state_note("sgd-momentum", 28) == "one fp32 buffer (4 B) per parameter"


def test_resnet_tiny_peaks_in_its_update_and_every_view_reads_that_peak(tmp_path):
    """Issue 33 item 9: one figure for one config. resnet-tiny's activations are small, so its step peaks inside
    AdamW's update, which the capture now measures (a second, steady-state update under a storage count) as the
    parallel simulation's tracker does. Before: the capture's step peak was its forward + backward peak plus the
    state (2,938,992 B) where the simulation read 3,157,800 B."""
    from graphviz_core.cli import main

    capture = captured("resnet-tiny")
    measured = capture.optimizer
    params = 4 * 177_362  # resnet-tiny's float32 parameters: 709,448 B, in 62 tensors
    assert (capture.summary.parameter_count, capture.summary.parameters) == (177_362, 62)
    batch = 2 * 3 * 32 * 32 * 4 + 2 * 8  # two 3x32x32 float32 images and two int64 labels: 24,592 B
    # held when the update starts: the weights, their gradients (as large), the batch and the 4 B loss
    assert measured.held_bytes == 2 * params + batch + 4 == 1_443_492
    # AdamW (single-tensor on CPU) computes denom = exp_avg_sq.sqrt() / bias_correction2_sqrt: at the largest
    # parameter (a 64x64x3x3 convolution, 36,864 scalars) the square root and the quotient are alive together, with
    # the denominator of the parameter before it (a 64-channel BatchNorm's, 64 x 4 B) not yet let go
    assert measured.update_bytes == 2 * 36_864 * 4 + 64 * 4 == 295_168
    state = 2 * params + 4 * 62  # two moments and a step count per tensor
    step = training_step_of(capture)
    assert step.optimizer_state_bytes == state
    assert step.step_peak_bytes == measured.held_bytes + state + measured.update_bytes == 3_157_804
    assert step.step_peak_bytes > step.forward_backward_peak_bytes + state  # the update is the peak
    assert step.update_peak_bytes == step.step_peak_bytes
    from graphviz_core.analysis.step_terms import step_parts

    note = dict((name, why) for name, _, why in step_parts(capture, step))["step peak"]
    assert note.startswith("measured in the optimizer's update"), note
    out = tmp_path / "g.json"
    assert main(["graph", "--preset", "resnet-tiny", "--strategy", "ddp", "--world-size", "2", "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["per_rank"]["single_device"]["peak_bytes"] == result["memory"]["training_step"]["step_peak_bytes"]
    assert result["memory"]["training_step"]["step_peak_bytes"] == 3_157_804
