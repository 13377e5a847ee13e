"""Memory of one whole training step: parameters, gradients, optimizer state and the measured activations.

Per parameter, at the model's dtype: the weight and its gradient. With a 16-bit dtype, mixed-precision
training keeps an fp32 master copy of every weight (4 bytes) that the optimizer updates. Optimizer state
is fp32: SGD keeps none, SGD with momentum one buffer (4 bytes), Adam and AdamW two moments (8 bytes) —
the "16 bytes per parameter" of mixed-precision Adam (ZeRO, Rajbhandari et al. 2020, section 3.1: 2 + 2 +
4 + 4 + 4) — and Adam and AdamW also a `step` count per parameter *tensor* (torch >= 2 keeps it as a float32
scalar tensor in the optimizer's state). The forward + backward part is measured (the memory timeline's
peak); optimizer state and master weights are alive for the whole step, so they add to it.

`optimizer_state_bytes` is the one rule for the optimizer's state: this module and the parallel simulation's
closed form (graphviz_core.parallel.simulate) both use it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from graphviz_core.capture.device import BYTES_PER
from graphviz_core.capture.result import Capture

# fp32 state tensors the optimizer keeps per parameter
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
# Step counts the optimizer keeps per parameter tensor: torch's Adam and AdamW hold state["step"], a float32
# scalar tensor (4 bytes) for each parameter tensor; SGD's only state is its momentum buffer.
STEP_COUNTERS = {"sgd": 0, "sgd-momentum": 0, "adam": 1, "adamw": 1}
STEP_COUNTER_BYTES = 4
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
    parameter_tensors: int  # tensors the optimizer updates: each gets its own step count (Adam, AdamW)
    parameter_bytes: int
    gradient_bytes: int
    master_weight_bytes: int
    optimizer_state_bytes: int  # moments (fp32, per parameter) + step counts (per tensor): optimizer_state_bytes()
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


def optimizer_state_bytes(optimizer: str, moment_bytes: int, parameter_tensors: int) -> int:
    """The bytes torch's `optimizer` keeps between steps: OPTIMIZER_STATES tensors shaped like the parameters
    (`moment_bytes`: the bytes of one such tensor for every parameter, e.g. 4 x parameters in fp32), plus a
    4-byte step count per parameter tensor for Adam and AdamW."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of: {', '.join(OPTIMIZER_STATES)}.")
    return OPTIMIZER_STATES[optimizer] * moment_bytes + STEP_COUNTERS[optimizer] * STEP_COUNTER_BYTES * parameter_tensors


def optimizer_state_note(optimizer: str, parameter_tensors: int) -> str:
    """What `optimizer_state_bytes` counts, in words ("two fp32 moments (8 B) per parameter + a 4 B step count for
    each of 28 tensors")."""
    moments = {0: "none", 1: "one fp32 buffer (4 B) per parameter", 2: "two fp32 moments (8 B) per parameter"}
    note = moments[OPTIMIZER_STATES[optimizer]]
    if STEP_COUNTERS[optimizer]:
        note += f" + a {STEP_COUNTER_BYTES} B step count for each of {parameter_tensors:,} tensors"
    return note


def training_step(
    parameter_count: int,
    dtype: str,
    optimizer: str,
    forward_backward_peak_bytes: int,
    activation_peak_bytes: int,
    parameter_tensors: int = 0,
) -> TrainingStep:
    """The step's memory from a parameter count (in `parameter_tensors` tensors; 0 leaves the step counts out,
    a lower bound) and the measured forward + backward peaks."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of: {', '.join(OPTIMIZER_STATES)}.")
    if dtype not in BYTES_PER:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(BYTES_PER)}.")
    mixed = BYTES_PER[dtype] < FP32_BYTES
    weights = parameter_count * BYTES_PER[dtype]
    master = parameter_count * FP32_BYTES if mixed else 0
    state = optimizer_state_bytes(optimizer, parameter_count * FP32_BYTES, parameter_tensors)
    return TrainingStep(
        optimizer=optimizer,
        dtype=dtype,
        mixed_precision=mixed,
        parameter_count=parameter_count,
        parameter_tensors=parameter_tensors,
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
        parameter_tensors=capture.summary.parameters,
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
