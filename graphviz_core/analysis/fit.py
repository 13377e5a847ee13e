"""Will it fit: the largest batch and the largest seq whose training step fits a memory budget, per checkpoint
policy, found by bisection over shapes-only (`meta`) captures, next to the closed-form prediction.

A probe is a meta capture's step peak (training_step: timeline peak + optimizer state + master weights).
Deep models are probed at 2 and 3 layers and extrapolated to their depth (parameters and every per-layer
activation grow by the same amount per identical layer); the answer is then checked with captures at the
full depth — n fits and n + 1 does not — and the bisection resumes on full-depth captures if the check fails.
The prediction applies the same optimizer arithmetic to the measured parameter count plus Korthikanti et
al.'s per-layer activations ("Backprop as a Graph") for the policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from graphviz_core.analysis.checkpointing import policies_for
from graphviz_core.analysis.memory_formulas import KORTHIKANTI_POLICIES, korthikanti_policy_layer_bytes
from graphviz_core.analysis.training_step import training_step, training_step_of
from graphviz_core.capture.engine import capture_backward
from graphviz_core.capture.result import Capture
from graphviz_core.config import LIMITS, ModelConfig, applies

DIMENSIONS = ("batch", "seq")
_EXTRAPOLATE_FROM = (2, 3)  # layers probed for deep models


@dataclass(frozen=True)
class FitResult:
    policy: str
    dimension: str  # "batch" or "seq"
    largest: int  # 0: not even 1 fits
    largest_step_peak_bytes: int | None  # measured at full depth for `largest` (None when 0)
    predicted_largest: int | None  # closed form ("Backprop as a Graph" / Korthikanti); None without transformer layers
    at_limit: bool  # `largest` is the tool's ceiling for that field, not the memory's
    weights_alone_exceed: bool  # parameters + gradients + master weights + optimizer state exceed the budget
    captures: int  # meta captures this search ran


@dataclass(frozen=True)
class FitSearch:
    config: ModelConfig
    budget_bytes: int
    optimizer: str
    results: tuple[FitResult, ...]

    def result(self, policy: str, dimension: str) -> FitResult:
        return next(r for r in self.results if r.policy == policy and r.dimension == dimension)


def _probe_config(
    config: ModelConfig, policy: str, dimension: str, value: int, layers: int | None = None
) -> ModelConfig:
    changes: dict = {"checkpoint": policy, "device": "meta", dimension: value}
    if dimension == "seq" and applies("context", config.model):
        changes["context"] = 0  # position embeddings grow with seq (context 0 means "same as seq")
    if layers is not None:
        changes["layers"] = layers
    return config.replace(**changes)


Capturer = Callable[[ModelConfig], Capture]  # runs one meta capture (a server passes its queued, cancellable one)


class _Prober:
    """Step peaks of probe configs, counting captures."""

    def __init__(self, config: ModelConfig, optimizer: str, capture: Capturer = capture_backward) -> None:
        self.capture = capture
        self.config = config
        self.optimizer = optimizer
        self.captures = 0
        # Only where `layers` counts identical blocks (ResNet's is a depth with its own stage plan).
        self.extrapolate = config.family.stacked_layers and config.layers > _EXTRAPOLATE_FROM[-1]
        self.known: dict[tuple, int] = {}

    def exact(self, policy: str, dimension: str, value: int) -> int:
        key = (policy, dimension, value)
        if key not in self.known:
            self.captures += 1
            capture = self.capture(_probe_config(self.config, policy, dimension, value))
            self.known[key] = training_step_of(capture, self.optimizer).step_peak_bytes
        return self.known[key]

    def quick(self, policy: str, dimension: str, value: int) -> int:
        if not self.extrapolate:
            return self.exact(policy, dimension, value)
        key = ("quick", policy, dimension, value)
        if key in self.known:
            return self.known[key]
        low, high = _EXTRAPOLATE_FROM
        steps = []
        for layers in (low, high):
            self.captures += 1
            capture = self.capture(_probe_config(self.config, policy, dimension, value, layers))
            steps.append(training_step_of(capture, self.optimizer))
        per_layer = steps[1].step_peak_bytes - steps[0].step_peak_bytes
        self.known[key] = steps[0].step_peak_bytes + (self.config.layers - low) * per_layer
        return self.known[key]


def _largest(fits: Callable[[int], bool], low: int, high: int, guess: int | None = None) -> int:
    """Largest n in [low, high] with fits(n), for a monotone `fits` (true up to some n); low - 1 if none.

    From `guess`, gallops (doubling steps up, halving down) until one probe fits and one does not, then
    bisects between them."""
    lo, hi = low - 1, high  # invariant: lo fits (or is below the range), the answer is at most hi
    if guess is not None:
        probe = min(max(guess, low), high)
        if fits(probe):
            lo, step = probe, probe
            while lo < hi:
                probe = min(hi, lo + step)
                if not fits(probe):
                    hi = probe - 1
                    break
                lo, step = probe, 2 * step
        else:
            hi = probe - 1
            while lo < hi:
                probe = max(lo + 1, (hi + 1) // 2)
                if fits(probe):
                    lo = probe
                    break
                hi = probe - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_fitting(
    config: ModelConfig,
    budget_bytes: int,
    policy: str,
    dimension: str,
    optimizer: str = "adamw",
    parameter_count: int | None = None,
    frozen_parameter_count: int = 0,
    capture: Capturer = capture_backward,
) -> FitResult:
    """The largest `dimension` (batch or seq) whose step peak under `policy` is at most `budget_bytes`.
    `parameter_count`: the trainable parameters (None: from a meta capture, which also gives the frozen ones);
    `frozen_parameter_count`: weights with no gradient or optimizer state (LoRA's base, --freeze)."""
    if dimension not in DIMENSIONS:
        raise ValueError(f"unknown dimension {dimension!r}; choose batch or seq.")
    if not applies(dimension, config.model):
        raise ValueError(f"model {config.model!r} has no {dimension}; search batch instead.")
    if not config.family.rebuildable:
        raise ValueError("will-it-fit rebuilds the model at other sizes, which a custom module cannot do.")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        # a whole number of bytes: a float budget of inf compared above every peak and searched to the limits
        raise ValueError(f"the memory budget is a whole number of bytes above 0, got {budget_bytes!r}.")
    prober = _Prober(config, optimizer, capture)
    limit = LIMITS[dimension]
    if parameter_count is None:
        summary = capture(config.replace(device="meta")).summary
        parameter_count, frozen_parameter_count = summary.parameter_count, summary.frozen_parameter_count
        prober.captures += 1
    predicted = predicted_largest(config, budget_bytes, policy, dimension, optimizer, parameter_count,
                                  frozen_parameter_count)

    # Parameters, gradients, master weights and optimizer state alone over budget: nothing fits, no capture
    # needed (at seq 1 a gpt2's position table has one row, so its other rows are left out of this bound).
    grows = dimension == "seq" and applies("context", config.model)
    floor_count = parameter_count - (config.positions - 1) * config.hidden * grows
    if floor_count < 0:  # LoRA: the position table is among the frozen weights; take its rows off those
        floor_count, frozen_parameter_count = 0, frozen_parameter_count + floor_count
    floor = training_step(floor_count, config.dtype, optimizer, 0, 0, frozen_parameter_count=frozen_parameter_count)
    if floor.sum_of_parts_bytes > budget_bytes:
        return FitResult(policy, dimension, 0, None, predicted, False, True, prober.captures)

    def exact_fits(n: int) -> bool:
        return prober.exact(policy, dimension, n) <= budget_bytes

    # BatchNorm (ResNet) cannot train on one example at 1x1 spatial size: its batches start at 2.
    low = config.family.min_batch if dimension == "batch" else 1
    guess = max(low, predicted or low)
    candidate = _largest(lambda n: prober.quick(policy, dimension, n) <= budget_bytes, low, limit, guess)
    # One full-depth capture checks the extrapolation where it decided (the answer, or 1 when nothing fits);
    # where it is not exact there, the search runs again on full-depth captures.
    check = max(candidate, low)
    if prober.extrapolate and prober.exact(policy, dimension, check) != prober.quick(policy, dimension, check):
        candidate = _largest(exact_fits, low, limit, check)
    candidate = candidate if candidate >= low else 0
    peak = prober.exact(policy, dimension, candidate) if candidate else None
    return FitResult(policy, dimension, candidate, peak, predicted, candidate == limit, False, prober.captures)


def predicted_largest(
    config: ModelConfig, budget_bytes: int, policy: str, dimension: str, optimizer: str, parameter_count: int,
    frozen_parameter_count: int = 0,
) -> int | None:
    """Closed form: parameters, gradients, master weights and optimizer state for `parameter_count`, plus
    layers x Korthikanti's per-layer activation bytes for the policy; the largest value within budget."""
    if not config.family.has_attention or policy not in KORTHIKANTI_POLICIES:  # per transformer layer, his policies
        return None
    fixed = training_step(parameter_count, config.dtype, optimizer, 0, 0,
                          frozen_parameter_count=frozen_parameter_count).sum_of_parts_bytes

    def fits(n: int) -> bool:
        probe = config.replace(**({dimension: n, "context": 0} if applies("context", config.model) else {dimension: n}))
        return fixed + config.layers * korthikanti_policy_layer_bytes(probe, policy) <= budget_bytes

    return _largest(fits, 1, LIMITS[dimension])


def will_it_fit(
    config: ModelConfig,
    budget_bytes: int,
    optimizer: str = "adamw",
    dimensions: tuple[str, ...] = DIMENSIONS,
    parameter_count: int | None = None,
    progress: Callable[[str], None] | None = None,
    frozen_parameter_count: int = 0,
    capture: Capturer = capture_backward,
) -> FitSearch:
    """Every policy the model supports x every dimension asked for; `parameter_count` (the config's, from a
    capture already made) saves a capture for the prediction. `capture` runs each meta capture."""
    count, frozen = parameter_count, frozen_parameter_count
    if count is None:
        summary = capture(config.replace(device="meta")).summary
        count, frozen = summary.parameter_count, summary.frozen_parameter_count
    results = []
    for policy in policies_for(config):
        for dimension in (d for d in dimensions if applies(d, config.model)):
            if progress:
                progress(f"largest {dimension} with checkpoint {policy}")
            results.append(largest_fitting(config, budget_bytes, policy, dimension, optimizer, count, frozen, capture))
    return FitSearch(config, budget_bytes, optimizer, tuple(results))
