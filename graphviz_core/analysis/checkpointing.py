"""Checkpointing side by side: the same config captured once per policy its family offers (none, full,
selective-attention, selective-ops), one row each.

Each policy is a real capture (on `meta` unless asked otherwise: shapes only, so any size is quick). A
checkpointed region keeps its *inputs* for recomputation instead of its saved tensors (and a selective policy
the outputs it chose to keep, stored by the checkpoint itself), so the figure to compare across policies is
what the forward leaves for backward, saved + held (`kept_for_backward_bytes`), not saved alone. Recompute FLOPs are the forward ops re-run inside
backward; PyTorch's non-reentrant checkpoint stops re-running a region as soon as it has rebuilt the last
tensor the backward needs (`torch.utils.checkpoint`'s early stop), so a region's last ops (e.g. the final
linear of a block, whose output nothing saved) never run again and recompute is less than a full forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from graphviz_core.analysis.training_step import training_step_of
from graphviz_core.capture.result import Capture
from graphviz_core.capture.workers import capture_many
from graphviz_core.config import ModelConfig


@dataclass(frozen=True)
class PolicyMemory:
    """One checkpoint policy's memory and compute, from its own capture."""

    policy: str
    kept_for_backward_bytes: int  # the headline: what the forward leaves alive for backward, saved + held
    saved_bytes: int  # tensors saved for backward
    held_bytes: int  # what checkpointed regions keep to recompute the rest: their inputs, a policy's kept outputs
    activation_peak_bytes: int  # timeline: most bytes live besides parameters and gradients
    forward_backward_peak_bytes: int  # timeline peak, parameters and gradients included
    step_peak_bytes: int  # plus optimizer state and master weights (see training_step)
    forward_flops: int
    backward_flops: int  # recompute included
    recompute_flops: int  # forward ops re-run inside backward
    recompute_over_forward: float  # recompute_flops / forward_flops
    extra_time_fraction: float  # recompute / (forward + backward without it): extra step time at one FLOP rate
    extra_time_s: float | None  # extra_time_fraction x a measured step time, when one is given


@dataclass(frozen=True)
class CheckpointComparison:
    config: ModelConfig  # the config compared (its checkpoint field is each row's policy)
    device: str
    optimizer: str
    rows: tuple[PolicyMemory, ...]

    def row(self, policy: str) -> PolicyMemory:
        return next(r for r in self.rows if r.policy == policy)


def policies_for(config: ModelConfig) -> tuple[str, ...]:
    """The policies that mean something for this family (selective-attention needs an attention core; an MLP has none)."""
    return config.family.checkpoint_policies()


def policy_memory(capture: Capture, optimizer: str = "adamw", step_time_s: float | None = None) -> PolicyMemory:
    """The row for one capture; `step_time_s` (a measured forward + backward without checkpointing) turns the
    extra-time fraction into seconds."""
    memory, flops = capture.memory, capture.flops
    step = training_step_of(capture, optimizer)
    without = flops.forward + flops.backward - flops.backward_recompute
    fraction = flops.backward_recompute / without if without else 0.0
    return PolicyMemory(
        policy=capture.config.checkpoint,
        kept_for_backward_bytes=memory.kept_for_backward_bytes,
        saved_bytes=memory.saved_bytes,
        held_bytes=memory.checkpoint_held_bytes,
        activation_peak_bytes=step.activation_peak_bytes,
        forward_backward_peak_bytes=step.forward_backward_peak_bytes,
        step_peak_bytes=step.step_peak_bytes,
        forward_flops=flops.forward,
        backward_flops=flops.backward,
        recompute_flops=flops.backward_recompute,
        recompute_over_forward=flops.backward_recompute / flops.forward if flops.forward else 0.0,
        extra_time_fraction=fraction,
        extra_time_s=None if step_time_s is None else fraction * step_time_s,
    )


def compare_checkpointing(
    config: ModelConfig,
    device: str = "meta",
    optimizer: str = "adamw",
    step_time_s: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> CheckpointComparison:
    """Capture `config` once per checkpoint policy on `device` (meta by default) and tabulate them. On meta the
    policies are captured side by side in other processes where there are some (graphviz_core.capture.workers)."""
    captures = capture_many(policy_configs(config, device), progress=progress)
    return checkpointing_table(config, device, optimizer, captures, step_time_s)


def policy_configs(config: ModelConfig, device: str = "meta") -> list[ModelConfig]:
    """The configs the comparison captures: `config` under each policy its family offers, on `device`."""
    return [config.replace(checkpoint=policy, device=device) for policy in policies_for(config)]


def checkpointing_table(config: ModelConfig, device: str, optimizer: str, captures: list[Capture],
                        step_time_s: float | None = None) -> CheckpointComparison:
    """The table of captures already made, one per policy (policy_configs): a pure function of them, so a page can
    have them captured where every capture is queued, limited and cancellable (graphviz_core.serve)."""
    rows = [policy_memory(capture, optimizer, step_time_s) for capture in captures]
    return CheckpointComparison(config, device, optimizer, tuple(rows))
