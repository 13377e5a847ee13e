"""Training-step totals against hand arithmetic: bytes per parameter for each optimizer and dtype."""

import pytest

from graphviz_core.analysis.training_step import ACCELERATORS, accelerator_fits, training_step, training_step_of
from tests.conftest import captured


def test_adam_fp32_keeps_two_fp32_moments_per_parameter():
    # 1_000 parameters in fp32: weights 4_000 B, grads 4_000 B, no master copy, Adam m and v 2 x 4 x 1_000 = 8_000 B
    step = training_step(1_000, "float32", "adam", forward_backward_peak_bytes=50_000, activation_peak_bytes=30_000)
    assert (step.parameter_bytes, step.gradient_bytes, step.master_weight_bytes, step.optimizer_state_bytes) == (
        4_000,
        4_000,
        0,
        8_000,
    )
    assert step.step_peak_bytes == 50_000 + 8_000
    assert step.sum_of_parts_bytes == 4_000 + 4_000 + 8_000 + 30_000


def test_mixed_precision_adamw_is_sixteen_bytes_per_parameter_before_activations():
    # bf16: weights 2 + grads 2 + fp32 master 4 + two fp32 moments 8 = 16 B per parameter
    step = training_step(10**9, "bfloat16", "adamw", forward_backward_peak_bytes=0, activation_peak_bytes=0)
    assert step.mixed_precision
    assert step.sum_of_parts_bytes == 16 * 10**9
    assert step.master_weight_bytes == 4 * 10**9


@pytest.mark.parametrize(("optimizer", "state_bytes"), [("sgd", 0), ("sgd-momentum", 4), ("adam", 8), ("adamw", 8)])
def test_optimizer_state_per_parameter(optimizer, state_bytes):
    assert training_step(7, "float16", optimizer, 0, 0).optimizer_state_bytes == 7 * state_bytes


def test_unknown_optimizer_is_a_sentence():
    with pytest.raises(ValueError, match="choose one of: sgd, sgd-momentum, adam, adamw"):
        training_step(1, "float32", "lion", 0, 0)


def test_the_captured_step_adds_adamw_state_to_the_measured_peak():
    capture = captured("gpt2-tiny")
    step = training_step_of(capture)
    # gpt2-tiny: wte 512x64 (tied lm_head) + wpe 32x64 + 2 blocks x 49_984 + ln_f 128 = 134_912 parameters
    assert step.parameter_count == 512 * 64 + 32 * 64 + 2 * (4 * 64 * 64 + 4 * 64 + 8 * 64 * 64 + 5 * 64 + 4 * 64) + 128
    assert step.parameter_count == 134_912
    # AdamW: two fp32 moments per parameter (8 x 134_912) + a float32 step count per tensor (4 x 28 tensors)
    assert step.parameter_tensors == 28
    assert step.step_peak_bytes == capture.memory.peak_bytes + 8 * 134_912 + 4 * 28


def test_a_70b_class_step_fits_none_of_the_single_accelerators():
    capture = captured("llama-3.1-70b")  # the real Llama 3.1 70B on meta, 80 layers
    step = training_step_of(capture)
    h, L, V, kv, inter = 8192, 80, 128_256, 8 * 128, 28_672
    # embedding + untied lm_head 2*V*h, per layer q and o h^2 each, k and v h*kv each, SwiGLU 3*h*inter, two
    # RMSNorm weights 2h (855_654_400), final norm h = 70_553_706_496 parameters (Meta's published count)
    assert step.parameter_count == 2 * V * h + L * (2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h) + h == 70_553_706_496
    assert step.mixed_precision and step.dtype == "bfloat16"
    # 16 B per parameter before any activation: 1_128_859_303_936 B, about 8x the largest single card; plus
    # AdamW's 4 B step count per tensor: embedding, lm_head, 9 per layer (q, k, v, o, gate, up, down, 2 norms),
    # the final norm = 2 + 80 * 9 + 1 = 723 tensors
    assert step.parameter_tensors == 2 + L * 9 + 1 == 723
    assert step.sum_of_parts_bytes - step.activation_peak_bytes == 16 * 70_553_706_496 + 4 * 723
    fits = accelerator_fits(step.step_peak_bytes)
    assert [f.name for f in fits] == list(ACCELERATORS)
    assert not any(f.fits for f in fits)
    assert accelerator_fits(10 * 2**30)[0].fits  # 10 GiB fits a 24 GB card
