"""--optimizer: the state the memory panel counts is what torch.optim itself keeps after one step of the chosen
optimizer, on CPU (the captured gradients) and on meta (the state torch.optim builds), never a multiplier."""

from __future__ import annotations

import pytest
import torch

from graphviz_core.analysis.step_terms import step_parts
from graphviz_core.analysis.training_step import FORMULA, MEASURED, MEASURED_META, training_step_of
from graphviz_core.config import OPTIMIZERS, config_from_preset
from graphviz_core.models.registry import build_model, compute_loss, make_batch
from tests.conftest import captured

P = 139_584  # llama-tiny's parameters (tests/test_autocast.py derives it)
TENSORS = 21  # its parameter tensors: 2 layers x 9 + embedding + final norm + lm_head
TORCH_OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps), "adam": lambda ps: torch.optim.Adam(ps),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1), "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adafactor": lambda ps: torch.optim.Adafactor(ps),
}


def _state_after_a_step(optimizer: str) -> tuple[int, list[torch.Size]]:
    """The test's own training step of llama-tiny: forward, backward, one torch.optim step, its state's bytes."""
    config = config_from_preset("llama-tiny", device="cpu")
    torch.manual_seed(0)
    model = build_model(config)
    batch = make_batch(config, "cpu")
    compute_loss(config, model(batch.inputs), batch.targets).backward()
    opt = TORCH_OPTIMIZERS[optimizer](list(model.parameters()))
    opt.step()
    total = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return total, [p.shape for p in model.parameters()]


def _adafactor_bytes(shapes: list[torch.Size]) -> int:
    """Adafactor (torch.optim.Adafactor) keeps, per matrix (r, c), a row factor of r and a column factor of c fp32
    values; per vector of n, its full second moment (n); per tensor a 4 B step count."""
    total = 0
    for shape in shapes:
        total += 4 * (shape[0] + shape[1]) if len(shape) == 2 else 4 * shape.numel()
        total += 4
    return total


# Per choice, by formula: SGD keeps nothing; SGD with momentum one fp32 buffer per parameter (4 P); Adam and AdamW
# two fp32 moments (8 P) and a 4 B step count per tensor; Adafactor its factored rows and columns (_adafactor_bytes).
EXPECTED = {"sgd": 0, "sgd-momentum": 4 * P, "adam": 8 * P + 4 * TENSORS, "adamw": 8 * P + 4 * TENSORS}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_each_optimizer_state_is_torch_optims_own_after_a_step(optimizer):
    capture = captured("llama-tiny", device="cpu", optimizer=optimizer)
    theirs, shapes = _state_after_a_step(optimizer)
    expected = EXPECTED[optimizer] if optimizer in EXPECTED else _adafactor_bytes(shapes)
    assert capture.optimizer.optimizer == optimizer and capture.optimizer.stepped
    assert capture.optimizer.state_bytes == theirs == expected
    step = training_step_of(capture)
    assert step.optimizer_state_bytes == expected and step.optimizer_state_source == MEASURED
    assert step.step_peak_bytes == step.forward_backward_peak_bytes + expected


def test_adafactor_keeps_factored_rows_and_columns():
    capture = captured("llama-tiny", device="cpu", optimizer="adafactor")
    by_key = capture.optimizer.bytes_by_key
    # 2-D weights: q (64, 64), k and v (32, 64) [out, in], o (64, 64), gate and up (128, 64), down (64, 128), per layer;
    # the embedding and lm_head (512, 64). Row factors hold the rows, column factors the columns, fp32.
    rows = 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64) + 2 * 512
    cols = 2 * (64 * 6 + 128) + 2 * 64
    assert by_key == {"col_var": 4 * cols, "row_var": 4 * rows, "step": 4 * TENSORS, "variance": 4 * 5 * 64}
    assert capture.optimizer.state_bytes < P  # far below AdamW's 8 P


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adafactor", "adamw"])
def test_a_meta_dry_run_reads_the_same_state_from_torch_optim(optimizer):
    cpu = captured("llama-tiny", device="cpu", optimizer=optimizer)
    meta = captured("llama-tiny", device="meta", optimizer=optimizer)
    assert meta.optimizer.bytes_by_key == cpu.optimizer.bytes_by_key
    assert training_step_of(meta).optimizer_state_source == MEASURED_META


def test_the_formula_is_used_only_for_an_optimizer_the_capture_did_not_step():
    capture = captured("llama-tiny", device="cpu")  # AdamW stepped
    assert training_step_of(capture, "sgd").optimizer_state_source == FORMULA
    assert training_step_of(capture, "sgd").optimizer_state_bytes == 0


def test_the_step_line_names_the_optimizer_and_its_state_keys():
    capture = captured("llama-tiny", device="cpu", optimizer="sgd-momentum")
    terms = {t: (b, what) for t, b, what in step_parts(capture, training_step_of(capture))}
    assert terms["optimizer state"][0] == 4 * P
    assert terms["optimizer state"][1].startswith("SGD with momentum: momentum_buffer 545.2 KiB")  # 4 x 139,584 B
