"""What a capture returns: the annotated graph and its summaries, as frozen dataclasses with units in field names."""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from graphviz_core.capture.timeline import MemoryTimeline
from graphviz_core.config import ModelConfig


@dataclass(frozen=True)
class SaveEvent:
    """One tensor saved for backward, in the forward order it was saved."""

    order: int
    node: str  # id of the node whose backward needs it
    shape: tuple[int, ...]
    dtype: str
    storage_bytes: int
    counted: bool  # False when the storage is a parameter's or was already counted for an earlier save


@dataclass(frozen=True)
class GraphSummary:
    nodes: int
    edges: int
    by_category: dict[str, int]
    by_op: dict[str, int]
    parameters: int  # AccumulateGrad nodes = parameter tensors reached by backward: the ones that train
    parameter_count: int  # scalars in those tensors
    frozen_parameters: int = 0  # parameter tensors with requires_grad off (LoRA's base weights, --freeze): no node
    frozen_parameter_count: int = 0  # scalars in those tensors


@dataclass(frozen=True)
class MemorySummary:
    """The capture's bytes. The headline is `kept_for_backward_bytes`: what the forward leaves alive for the
    backward, saved tensors plus what checkpointing holds to recompute the rest: the one number to compare across
    checkpoint policies (saved_bytes alone drops what a checkpoint keeps itself)."""

    saved_bytes: int  # tensors saved for backward, storages de-duplicated, parameters excluded
    parameter_bytes: int  # parameters reached by backward, plus the frozen ones (they are in memory all the same)
    buffer_bytes: int  # the model's buffers (BatchNorm running statistics, rotary tables): no gradient, not parameters
    gradient_bytes: int  # .grad of every parameter reached (the trainable ones)
    peak_bytes: int  # CUDA max_memory_allocated over forward + backward; elsewhere the timeline's peak
    baseline_bytes: int | None  # allocated before the forward (parameters, inputs); CUDA only
    checkpoint_held_bytes: int  # inputs that checkpointed regions keep for recomputation (not saved tensors)
    saved_bytes_by_category: dict[str, int]
    kept_for_backward_bytes: int = field(init=False)  # saved_bytes + checkpoint_held_bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "kept_for_backward_bytes", self.saved_bytes + self.checkpoint_held_bytes)


@dataclass(frozen=True)
class FlopSummary:
    forward: int
    backward: int  # every aten op that ran during backward, including the two items below
    backward_by_category: dict[str, int]
    backward_unattributed: int  # ran between nodes: the engine summing gradients where paths meet
    backward_recompute: int  # forward ops re-run by checkpointing inside backward
    # Where the work went, for flop_analysis: forward FLOPs by innermost module, and both passes by aten op.
    forward_by_module: dict[str, int] = field(default_factory=dict)
    forward_by_op: dict[str, int] = field(default_factory=dict)
    forward_by_module_op: dict[str, dict[str, int]] = field(default_factory=dict)  # module -> aten op -> FLOPs
    backward_by_op: dict[str, int] = field(default_factory=dict)


# Below this share of the wall time on the CPU, the capturing thread spent the rest waiting: for the interpreter lock
# (another session's Python on a shared server) or for a core (other processes). Undisturbed runs here read 0.9-1.0.
DISTURBED_BELOW = 0.7


@dataclass(frozen=True)
class TimeSummary:
    forward_s: float | None  # wall time with instrumentation; None on meta
    backward_s: float | None
    # CPU time of the capturing thread over the same spans (CPU device only; None elsewhere): how much of the wall
    # time it was running at all. Intra-op worker threads are not counted, but the capturing thread works beside them.
    forward_cpu_s: float | None = None
    backward_cpu_s: float | None = None

    @property
    def cpu_share(self) -> float | None:
        """Thread CPU time / wall time over forward + backward; None where not measured."""
        if self.forward_cpu_s is None or self.backward_cpu_s is None or not self.forward_s or not self.backward_s:
            return None
        return (self.forward_cpu_s + self.backward_cpu_s) / (self.forward_s + self.backward_s)

    @property
    def disturbed(self) -> bool:
        """True when the times mostly measure waiting, not this config: see DISTURBED_BELOW."""
        share = self.cpu_share
        return share is not None and share < DISTURBED_BELOW

    def note(self) -> str | None:
        """One sentence for a disturbed measurement, None otherwise."""
        if not self.disturbed:
            return None
        return (f"Timing disturbed: the capturing thread ran for only {self.cpu_share:.0%} of the forward + backward "
                f"wall time, waiting the rest for a CPU core or for other Python on this server, so these times mostly "
                f"measure the wait (FLOPs, bytes and the graph are unaffected; run it again on a quieter server).")


@dataclass(frozen=True)
class OptimizerState:
    """What the config's torch.optim optimizer kept after one step over the captured parameters
    (graphviz_core.capture.instruments.optimizer)."""

    optimizer: str
    state_bytes: int  # every tensor in optimizer.state, storages counted once
    bytes_by_key: dict[str, int]  # state key (exp_avg, exp_avg_sq, step, momentum_buffer, row_var...) -> bytes
    tensors: int  # state tensors
    parameter_tensors: int  # parameters with a gradient that the optimizer stepped
    parameter_count: int  # their scalars
    stepped: bool  # the whole update ran (False: meta, or a step the GradScaler skipped)
    notes: tuple[str, ...] = ()
    held_bytes: int | None = None  # what the capture tracked alive when the step began: weights, gradients, batch
    update_bytes: int | None = None  # the most a steady-state update allocates beyond its state (None: not measured)


@dataclass(frozen=True)
class AutocastSummary:
    """What torch.autocast did in the forward (graphviz_core.capture.instruments.casts)."""

    dtype: str  # bfloat16 | float16: the dtype autocast's lower-precision ops ran in
    device_type: str  # the device type autocast ran for (cpu | cuda; a meta dry run's fake tensors' device)
    cast_nodes: int  # ToCopyBackward0 nodes autocast made (category `cast`)
    weight_casts: int  # of those, casts of a parameter (an fp32 weight's 16-bit copy)
    weight_copy_bytes: int  # the 16-bit weight copies saved for backward, storages counted once
    scaler: str  # what the gradient scaler did ("" without one: bfloat16 needs none)


@dataclass(frozen=True)
class Capture:
    """One captured backward pass: the graph (graph/schema.py's records) plus summaries."""

    config: ModelConfig
    device: str
    graph: nx.DiGraph
    summary: GraphSummary
    memory: MemorySummary
    flops: FlopSummary
    time: TimeSummary
    loss: float | None
    save_order: tuple[SaveEvent, ...] = field(repr=False)
    backward_order: tuple[str, ...] = field(repr=False)
    timeline: MemoryTimeline | None = field(default=None, repr=False)  # graphviz_core.capture.timeline
    optimizer: OptimizerState | None = None  # torch.optim's state after one step (the "optimizer" instrument)
    autocast: AutocastSummary | None = None  # what torch.autocast did (config.autocast other than none)
    notes: tuple[str, ...] = ()  # sentences about how this step ran (autocast, the GradScaler, the optimizer)
    compiled: dict | None = field(default=None, repr=False)  # --compile: regions, breaks, saved bytes (capture.compiled)
