"""The training step's memory as the terms a person adds up, each with what it is: weights, gradients, fp32 master
weights, the optimizer's state (torch.optim's own, by state key), the activations, and under autocast the 16-bit
weight copies autocast saved for backward, split out of the activations. The memory panel shows these rows and
`graphviz-core memory` writes them (`training_step_terms`)."""

from __future__ import annotations

from graphviz_core.analysis.training_step import FORMULA, OPTIMIZER_NAMES, TrainingStep, optimizer_state_note
from graphviz_core.capture.result import Capture
from graphviz_core.units import format_bytes


def optimizer_note(step: TrainingStep, parameter_tensors: int) -> str:
    """What the optimizer-state term holds, in words."""
    name = OPTIMIZER_NAMES[step.optimizer]
    if step.optimizer_state_source == FORMULA:
        return f"{name}, by formula: {optimizer_state_note(step.optimizer, parameter_tensors)}"
    if not step.optimizer_state_by_key:
        return f"{name} keeps no state ({step.optimizer_state_source})"
    keys = " + ".join(f"{key} {format_bytes(b)}" for key, b in step.optimizer_state_by_key.items())
    return f"{name}: {keys} ({step.optimizer_state_source})"


def _saved_by_dtype(capture: Capture, step: TrainingStep) -> str:
    """The saved activations by dtype, the weight copies left out ("saved for backward: 264.0 KiB bfloat16 + ...")."""
    by_dtype: dict[str, int] = {}
    for save in capture.save_order:
        if save.counted:
            by_dtype[save.dtype] = by_dtype.get(save.dtype, 0) + save.storage_bytes
    by_dtype[step.autocast] = by_dtype.get(step.autocast, 0) - step.weight_copy_bytes
    shown = " + ".join(f"{format_bytes(b)} {dtype}" for dtype, b in sorted(by_dtype.items(), key=lambda kv: -kv[1]) if b)
    return f"saved for backward: {shown}"


def step_parts(capture: Capture, step: TrainingStep) -> list[tuple[str, int, str]]:
    """(term, bytes, what it is) for every term of the step, then the sum and the step's peak."""
    dtype = capture.config.dtype
    # peft keeps LoRA's adapters in float32 over a 16-bit base: then they, and their gradients, are float32
    fp32_adapters = step.mixed_precision and step.gradient_bytes == 4 * step.parameter_count
    parts = [
        ("weights", step.parameter_bytes, f"{step.parameter_count + step.frozen_parameter_count:,} parameters × {dtype}"
         + (f", the {step.parameter_count:,} trainable ones float32" if fp32_adapters else "")
         + (" (the master weights autocast reads)" if step.autocast != "none" else "")),
        ("gradients", step.gradient_bytes, f"one per trainable parameter, {'float32' if fp32_adapters else dtype}"),
    ]
    if step.mixed_precision:
        parts.append(("fp32 master weights", step.master_weight_bytes,
                      "none: the trainable parameters are float32 already" if fp32_adapters else
                      "4 B per parameter (16-bit training updates an fp32 copy)"))
    parts.append(("optimizer state", step.optimizer_state_bytes, optimizer_note(step, capture.summary.parameters)))
    if step.autocast != "none":
        parts.append(("activations at their peak", step.activation_peak_bytes - step.weight_copy_bytes,
                      "measured (timeline), without the weight copies below; " + _saved_by_dtype(capture, step)))
        parts.append((f"{step.autocast} weight copies", step.weight_copy_bytes,
                      f"autocast's {step.autocast} copies of the weights, saved for backward (part of the "
                      "measured activation peak)"))
    else:
        parts.append(("activations at their peak", step.activation_peak_bytes, "measured (timeline)"))
    parts.append(("sum of the parts", step.sum_of_parts_bytes, "as if all were live at once"))
    parts.append(("step peak", step.step_peak_bytes, step_peak_note(step)))
    return parts


def step_peak_note(step: TrainingStep) -> str:
    """Which of the step's two moments is its peak, in words."""
    backward = step.forward_backward_peak_bytes + step.master_weight_bytes + step.optimizer_state_bytes
    if step.update_peak_bytes is not None and step.update_peak_bytes > backward:
        above = format_bytes(step.update_peak_bytes - backward)
        return ("measured in the optimizer's update: the weights, gradients, batch and loss held then, master weights, "
                f"the state, and what one update allocates beside them ({above} above the forward + backward peak + "
                "master weights + state)")
    return "measured forward + backward peak + master weights + optimizer state"
