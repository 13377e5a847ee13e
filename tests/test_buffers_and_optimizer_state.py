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
