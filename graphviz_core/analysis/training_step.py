"""Memory of one whole training step: parameters, gradients, optimizer state and the measured activations.

Per parameter, at the model's dtype: the weight and its gradient. With a 16-bit dtype, mixed-precision
training keeps an fp32 master copy of every weight (4 bytes) that the optimizer updates. Optimizer state
is fp32: SGD keeps none, SGD with momentum one buffer (4 bytes), Adam and AdamW two moments (8 bytes) —
the "16 bytes per parameter" of mixed-precision Adam (ZeRO, Rajbhandari et al. 2020, section 3.1: 2 + 2 +
4 + 4 + 4) — and Adam and AdamW also a `step` count per parameter *tensor* (torch >= 2 keeps it as a float32
scalar tensor in the optimizer's state). The forward + backward part is measured (the memory timeline's
peak); optimizer state and master weights are alive for the whole step, so they add to it.

Two paths for the optimizer's state, named in `TrainingStep.optimizer_state_source`:
- a captured config (`training_step_of`): the bytes torch.optim itself kept after one step of the config's optimizer
  over the captured parameters and gradients (Capture.optimizer, graphviz_core.capture.instruments.optimizer; on
  meta, the state torch.optim built with the same shapes and dtypes). Adafactor's factored row and column
  statistics, Adam's moments and step counts, SGD's nothing are what torch.optim holds, not a multiplier.
- no capture (will-it-fit's closed form, the parallel simulation's expectation): `optimizer_state_bytes`, the
  formula below. It counts Adafactor as its step counts only (its row and column factors, rows + columns per
  matrix, are left out: a lower bound).

Under autocast (config.autocast) the weights stay in the config's dtype (fp32 master weights are the weights, no
extra copy), the gradients too; the 16-bit copies of the weights autocast made and the ops saved for backward are
part of the measured activations, and shown as their own term (`weight_copy_bytes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from graphviz_core.capture.device import BYTES_PER
from graphviz_core.capture.instruments.optimizer import OPTIMIZER_NAMES as OPTIMIZER_NAMES  # re-exported
from graphviz_core.capture.instruments.optimizer import OPTIMIZER_STATES  # fp32 state tensors per parameter
from graphviz_core.capture.result import Capture, OptimizerState

# Step counts the optimizer keeps per parameter tensor: torch's Adam and AdamW hold state["step"], a float32
# scalar tensor (4 bytes) for each parameter tensor; SGD's only state is its momentum buffer.
STEP_COUNTERS = {"sgd": 0, "sgd-momentum": 0, "adam": 1, "adamw": 1, "adafactor": 1}
STEP_COUNTER_BYTES = 4
MEASURED = "torch.optim after one step"  # optimizer_state_source of a captured config
MEASURED_META = "torch.optim's state built on meta (shapes and dtypes)"
FORMULA = "formula"
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
    parameter_count: int  # the parameters that train (LoRA: the adapters; --freeze: all but the frozen)
    parameter_tensors: int  # tensors the optimizer updates: each gets its own step count (Adam, AdamW)
    parameter_bytes: int  # every weight, frozen ones included: they are in memory all the same
    gradient_bytes: int  # the trainable parameters' gradients only
    master_weight_bytes: int
    optimizer_state_bytes: int  # moments (fp32, per parameter) + step counts (per tensor): optimizer_state_bytes()
    activation_peak_bytes: int  # measured: the most bytes live besides parameters and gradients
    forward_backward_peak_bytes: int  # measured: the timeline's peak (parameters and gradients included)
    step_peak_bytes: int  # the larger of forward_backward_peak_bytes + master + state and update_peak_bytes
    sum_of_parts_bytes: int  # every part at once: parameters + gradients + master + state + activation peak
    frozen_parameter_count: int = 0  # weights with no gradient, no master copy and no optimizer state
    autocast: str = "none"  # the dtype the forward ran in under torch.autocast (config.autocast)
    weight_copy_bytes: int = 0  # autocast's 16-bit weight copies saved for backward: part of activation_peak_bytes
    optimizer_state_source: str = FORMULA  # MEASURED / MEASURED_META (a capture) or FORMULA (optimizer_state_bytes)
    optimizer_state_by_key: dict[str, int] = field(default_factory=dict)  # measured: state key -> bytes
    # measured: the optimizer's update as its own moment: what the step holds then (weights, gradients, batch, loss) +
    # master weights + state + what one steady-state update allocates beside them; None where it was not measured
    update_peak_bytes: int | None = None


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
    frozen_parameter_count: int = 0,
) -> TrainingStep:
    """The step's memory from a parameter count (in `parameter_tensors` tensors; 0 leaves the step counts out,
    a lower bound) and the measured forward + backward peaks. `frozen_parameter_count` weights (LoRA's base model,
    --freeze) take memory as weights but have no gradient, master copy or optimizer state."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of: {', '.join(OPTIMIZER_STATES)}.")
    if dtype not in BYTES_PER:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(BYTES_PER)}.")
    mixed = BYTES_PER[dtype] < FP32_BYTES
    weights = (parameter_count + frozen_parameter_count) * BYTES_PER[dtype]
    gradients = parameter_count * BYTES_PER[dtype]
    master = parameter_count * FP32_BYTES if mixed else 0
    state = optimizer_state_bytes(optimizer, parameter_count * FP32_BYTES, parameter_tensors)
    return TrainingStep(
        optimizer=optimizer,
        dtype=dtype,
        mixed_precision=mixed,
        parameter_count=parameter_count,
        parameter_tensors=parameter_tensors,
        parameter_bytes=weights,
        gradient_bytes=gradients,
        master_weight_bytes=master,
        optimizer_state_bytes=state,
        activation_peak_bytes=activation_peak_bytes,
        forward_backward_peak_bytes=forward_backward_peak_bytes,
        step_peak_bytes=forward_backward_peak_bytes + master + state,
        sum_of_parts_bytes=weights + gradients + master + state + activation_peak_bytes,
        frozen_parameter_count=frozen_parameter_count,
    )


def training_step_of(capture: Capture, optimizer: str | None = None) -> TrainingStep:
    """The training step of a captured model: its parameters, its measured timeline, and the state torch.optim kept
    after one step of the config's optimizer (Capture.optimizer). `optimizer` (default: the config's) other than the
    one the capture stepped, or a capture without the optimizer instrument, falls back to the formula."""
    optimizer = optimizer or capture.config.optimizer
    step = _formula_step_of(capture, optimizer)
    autocast = capture.autocast
    if autocast is not None:
        step = dataclasses.replace(step, autocast=autocast.dtype, weight_copy_bytes=autocast.weight_copy_bytes)
    measured = capture.optimizer
    if measured is None or measured.optimizer != optimizer:
        return step
    return with_measured_state(step, measured, capture.device == "meta")


def with_measured_state(step: TrainingStep, measured: OptimizerState, meta: bool) -> TrainingStep:
    """`step` with torch.optim's own state bytes in place of the formula's."""
    state = measured.state_bytes
    update_peak = None
    if measured.held_bytes is not None and measured.update_bytes is not None:
        # the update's own moment, counted as torch's MemTracker counts the parallel simulation's optimizer phase
        update_peak = measured.held_bytes + step.master_weight_bytes + state + measured.update_bytes
    peak = max(step.forward_backward_peak_bytes + step.master_weight_bytes + state, update_peak or 0)
    return dataclasses.replace(
        step,
        optimizer_state_bytes=state,
        step_peak_bytes=peak,
        sum_of_parts_bytes=step.sum_of_parts_bytes - step.optimizer_state_bytes + state,
        optimizer_state_source=MEASURED_META if meta else MEASURED,
        optimizer_state_by_key=dict(measured.bytes_by_key),
        update_peak_bytes=update_peak,
    )


def _formula_step_of(capture: Capture, optimizer: str) -> TrainingStep:
    timeline = capture.timeline
    step = training_step(
        capture.summary.parameter_count,
        capture.config.dtype,
        optimizer,
        capture.memory.peak_bytes,
        timeline.activation_peak_bytes if timeline else 0,
        parameter_tensors=capture.summary.parameters,
        frozen_parameter_count=capture.summary.frozen_parameter_count,
    )
    return _with_captured_dtypes(step, capture)


def _with_captured_dtypes(step: TrainingStep, capture: Capture) -> TrainingStep:
    """`step` with the weights and gradients the capture holds, where not every parameter is in the config's dtype:
    peft keeps LoRA's adapters in float32 over a 16-bit base model (get_peft_model's autocast_adapter_dtype), so they
    need no fp32 master copy and their gradients take 4 B each."""
    weights, gradients = capture.memory.parameter_bytes, capture.memory.gradient_bytes
    if (weights, gradients) == (step.parameter_bytes, step.gradient_bytes):
        return step
    # trainable scalars below fp32, each 2 B where the rest take 4 B: (4 B x count - gradient bytes) / 2
    sixteen_bit = max(0, (FP32_BYTES * step.parameter_count - gradients) // 2)
    master = FP32_BYTES * sixteen_bit if step.mixed_precision else 0
    state = step.optimizer_state_bytes
    return dataclasses.replace(
        step,
        parameter_bytes=weights,
        gradient_bytes=gradients,
        master_weight_bytes=master,
        step_peak_bytes=step.forward_backward_peak_bytes + master + state,
        sum_of_parts_bytes=weights + gradients + master + state + step.activation_peak_bytes,
    )


def accelerator_fits(step_peak_bytes: int) -> list[AcceleratorFit]:
    """Whether a step of this peak fits each common accelerator, one device, no sharding."""
    return [
        AcceleratorFit(name, capacity, step_peak_bytes <= capacity, capacity - step_peak_bytes)
        for name, capacity in ACCELERATORS.items()
    ]


def memory_details(capture: Capture) -> dict:
    """What the JSON's `memory` object adds to MemorySummary: `timeline` (see MemoryTimeline.to_dict) and
    `training_step` (the config's optimizer), so the CLI and the panel read the same numbers."""
    step = training_step_of(capture)
    return {
        "timeline": capture.timeline.to_dict() if capture.timeline else None,
        "training_step": dataclasses.asdict(step),
    }
