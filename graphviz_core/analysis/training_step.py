"""Memory of one whole training step: parameters, gradients, optimizer state and the measured activations.

Per parameter, at the model's dtype: the weight and its gradient. With a 16-bit dtype, mixed-precision
training keeps an fp32 master copy of every weight (4 bytes) that the optimizer updates. Optimizer state
is fp32: SGD keeps none, SGD with momentum one buffer (4 bytes), Adam and AdamW two moments (8 bytes) —
the "16 bytes per parameter" of mixed-precision Adam (ZeRO, Rajbhandari et al. 2020, section 3.1: 2 + 2 +
4 + 4 + 4). The forward + backward part is measured (the memory timeline's peak); optimizer state and
master weights are alive for the whole step, so they add to it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from graphviz_core.capture.device import BYTES_PER
from graphviz_core.capture.result import Capture

# fp32 state tensors the optimizer keeps per parameter
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
OPTIMIZER_NAMES = {"sgd": "SGD", "sgd-momentum": "SGD with momentum", "adam": "Adam", "adamw": "AdamW"}
DEFAULT_OPTIMIZER = "adamw"
FP32_BYTES = 4

# Usable memory as nvidia-smi reports it (MiB), for the cards people size jobs against.
ACCELERATORS: dict[str, int] = {
    "24 GB (RTX 4090)": 24_564 * 2**20,
    "40 GB (A100 40GB)": 40_960 * 2**20,
    "80 GB (H100 80GB)": 81_559 * 2**20,
    "141 GB (H200)": 143_771 * 2**20,
}


@dataclass(frozen=True)
class TrainingStep:
    """The bytes of one optimizer step, part by part, and the step's peak."""

    optimizer: str
    dtype: str
    mixed_precision: bool  # 16-bit weights with fp32 master weights
    parameter_count: int
    parameter_bytes: int
    gradient_bytes: int
    master_weight_bytes: int
    optimizer_state_bytes: int
    activation_peak_bytes: int  # measured: the most bytes live besides parameters and gradients
    forward_backward_peak_bytes: int  # measured: the timeline's peak (parameters and gradients included)
    step_peak_bytes: int  # forward_backward_peak_bytes + master weights + optimizer state
    sum_of_parts_bytes: int  # every part at once: parameters + gradients + master + state + activation peak


@dataclass(frozen=True)
class AcceleratorFit:
    name: str
    capacity_bytes: int
    fits: bool
    headroom_bytes: int  # negative when it does not fit


def training_step(
    parameter_count: int, dtype: str, optimizer: str, forward_backward_peak_bytes: int, activation_peak_bytes: int
) -> TrainingStep:
    """The step's memory from a parameter count and the measured forward + backward peaks."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of: {', '.join(OPTIMIZER_STATES)}.")
    if dtype not in BYTES_PER:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(BYTES_PER)}.")
    mixed = BYTES_PER[dtype] < FP32_BYTES
    weights = parameter_count * BYTES_PER[dtype]
    master = parameter_count * FP32_BYTES if mixed else 0
    state = parameter_count * FP32_BYTES * OPTIMIZER_STATES[optimizer]
    return TrainingStep(
        optimizer=optimizer,
        dtype=dtype,
        mixed_precision=mixed,
        parameter_count=parameter_count,
        parameter_bytes=weights,
        gradient_bytes=weights,
        master_weight_bytes=master,
        optimizer_state_bytes=state,
        activation_peak_bytes=activation_peak_bytes,
        forward_backward_peak_bytes=forward_backward_peak_bytes,
        step_peak_bytes=forward_backward_peak_bytes + master + state,
        sum_of_parts_bytes=2 * weights + master + state + activation_peak_bytes,
    )


def training_step_of(capture: Capture, optimizer: str = DEFAULT_OPTIMIZER) -> TrainingStep:
    """The training step of a captured model: its parameters and its measured timeline."""
    timeline = capture.timeline
    return training_step(
        capture.summary.parameter_count,
        capture.config.dtype,
        optimizer,
        capture.memory.peak_bytes,
        timeline.activation_peak_bytes if timeline else 0,
    )


def accelerator_fits(step_peak_bytes: int) -> list[AcceleratorFit]:
    """Whether a step of this peak fits each common accelerator, one device, no sharding."""
    return [
        AcceleratorFit(name, capacity, step_peak_bytes <= capacity, capacity - step_peak_bytes)
        for name, capacity in ACCELERATORS.items()
    ]


def memory_details(capture: Capture) -> dict:
    """What the JSON's `memory` object adds to MemorySummary: `timeline` (see MemoryTimeline.to_dict) and
    `training_step` (AdamW by default), so the CLI and the panel read the same numbers."""
    step = training_step_of(capture)
    return {
        "timeline": capture.timeline.to_dict() if capture.timeline else None,
        "training_step": dataclasses.asdict(step),
    }
