"""What a simulated step reports: rank 0's figures (`PerRank`, the CLI's `per_rank` JSON), the closed-form figures
beside them, a pipeline's stages and schedule, and the one function that builds a `PerRank` from a step run under the
trackers (the step of graphviz_core.parallel.simulate and each pipeline rank's)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from graphviz_core.capture.instruments.optimizer import OPTIMIZER_NAMES
from graphviz_core.config import ModelConfig
from graphviz_core.parallel.collectives import (
    GPUS_PER_NODE,
    INFINIBAND_BYTES_PER_S,
    NVLINK_BYTES_PER_S,
    Collective,
)
from graphviz_core.parallel.memory import PhaseMemory, PhasePeaks, buffers_of, downsample, parts_of, phase_memories
from graphviz_core.parallel.settings import ParallelConfig

INTERCONNECT = {
    "gpus_per_node": GPUS_PER_NODE,
    "nvlink_bytes_per_s": NVLINK_BYTES_PER_S,
    "infiniband_bytes_per_s": INFINIBAND_BYTES_PER_S,
}


@dataclass(frozen=True)
class Expectation:
    """The closed-form per-rank figures, for comparison with what torch's sharding produced."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    formula: str  # how they were computed, in words


@dataclass(frozen=True)
class PerRank:
    """One simulated training step seen from rank 0, and the same model on one device."""

    config: ModelConfig
    parallel: ParallelConfig
    rank: int
    mesh: dict[str, int]  # mesh dimension -> ranks along it
    parameter_count: int  # of the whole model
    parameter_bytes: int  # this rank's (sharded) parameters after the step, buffers not included
    buffer_bytes: int  # this rank's module buffers (BatchNorm statistics, rotary tables): every rank holds them whole
    gradient_bytes: int
    optimizer_bytes: int
    peak_bytes: int  # the most bytes live on this rank at any point of the step, module buffers left out
    phases: tuple[PhaseMemory, ...]
    timeline: tuple[tuple[str, int], ...] = field(repr=False)  # (phase, bytes live), sampled op by op
    collectives: tuple[Collective, ...] = field(repr=False)
    backward_nodes_by_category: dict[str, int]  # rank 0's autograd graph: tensor parallelism adds `communication`
    expected: Expectation
    single_device: PerRank | None = field(repr=False)  # the same step with strategy none (None for that one)
    simulate_s: float
    # FSDP units as torch set them up, read after the step: unit ("" = the root) -> whether its parameters were
    # resharded after forward (and gathered again in backward). Empty without FSDP.
    resharded_after_forward: dict[str, bool] = field(default_factory=dict)
    # Pipeline parallelism: every stage, the schedule, its bubble and transfers (graphviz_core.parallel.pipeline);
    # this PerRank is then pipeline rank 0's (stage 0's ranks). None without pipeline parallelism.
    pipeline: PipelineReport | None = field(default=None, repr=False)
    flops_by_phase: dict[str, int] = field(default_factory=dict)  # FLOPs this rank ran, forward / backward / optimizer
    # The most bytes live in each stretch of each phase: "forward/pre" (before the first layer), "forward/layer 3",
    # "backward/post" (after the last layer)... The planner scales these by layer count (parallel.planner).
    segment_peaks: dict[str, int] = field(default_factory=dict, repr=False)
    # Activations alive on this rank when forward has ended (the loss computed): what backward will read.
    forward_end_activation_bytes: int = 0
    # Context / sequence parallel: one layer's activations measured, counted and beside Korthikanti et al.
    # (graphviz_core.parallel.layer_activations.LayerActivations); None otherwise.
    layer_activations: object | None = field(default=None, repr=False)
    optimizer: str = "adamw"  # the torch.optim optimizer the step ran (config.optimizer)
    autocast: str = "none"  # the dtype torch.autocast ran the forward and loss in on every rank (config.autocast)
    notes: tuple[str, ...] = ()  # what the simulation did differently from a real step, in sentences

    def collective_bytes(self, phase: str | None = None) -> int:
        """Bytes this rank sends in the step (or one phase), ring algorithm."""
        return sum(c.traffic_bytes for c in self.collectives if phase is None or c.phase == phase)

    def collective_time_s(self, phase: str | None = None) -> float:
        return sum(c.time_s for c in self.collectives if phase is None or c.phase == phase)

    def reshard_summary(self) -> dict | None:
        """Which FSDP units free their gathered parameters after forward, as torch ran them: the root (embeddings,
        final norm, head) and the layers; None without FSDP."""
        if not self.resharded_after_forward:
            return None
        layers = {v for k, v in self.resharded_after_forward.items() if k}
        return {
            "root": self.resharded_after_forward.get(""),
            "layers": layers.pop() if len(layers) == 1 else sorted(layers),
            "modelled": "the root is wrapped as training scripts do (torchtitan: fully_shard(model) without "
            "reshard_after_forward): FSDP2's default keeps it unsharded after forward, so backward does not gather "
            "it again; the layers reshard unless --no-reshard-after-forward",
        }

    def phase(self, name: str) -> PhaseMemory:
        return next(p for p in self.phases if p.phase == name)

    def to_dict(self) -> dict:
        """The CLI's `per_rank` JSON object."""
        out = {
            "rank": self.rank,
            "ranks_symmetric": True,
            "optimizer": self.optimizer,
            "autocast": self.autocast,
            "notes": list(self.notes),  # every rank runs the same program on equal shards
            "parallel": self.parallel.to_dict(),
            "mesh": dict(self.mesh),
            "parameter_count": self.parameter_count,
            "parameter_bytes": self.parameter_bytes,
            "buffer_bytes": self.buffer_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "peak_bytes": self.peak_bytes,
            "phases": {p.phase: p.to_dict() for p in self.phases},
            "expected": dataclasses.asdict(self.expected),
            "resharded_after_forward": self.reshard_summary(),
            "backward_nodes_by_category": dict(self.backward_nodes_by_category),
            "collective_bytes": self.collective_bytes(),
            "collective_time_s": self.collective_time_s(),
            "backward_collective_bytes": self.collective_bytes("backward"),
            "backward_collective_time_s": self.collective_time_s("backward"),
            "interconnect": dict(INTERCONNECT),
            "collectives": [
                {
                    "kind": c.kind,
                    "phase": c.phase,
                    "bytes": c.buffer_bytes,
                    "traffic_bytes": c.traffic_bytes,
                    "group": c.group,
                    "group_size": c.group_size,
                    "link": c.link,
                    "time_s": c.time_s,
                    "module": c.module,
                    "parameters_of": c.parameters_of,
                    "autograd_node": c.autograd_node,
                    "issued_by": c.issued_by,
                }
                for c in self.collectives
            ],
            "flops_by_phase": dict(self.flops_by_phase),
            "forward_end_activation_bytes": self.forward_end_activation_bytes,
            "layer_activations": self.layer_activations.to_dict() if self.layer_activations is not None else None,
            "simulate_s": self.simulate_s,
        }
        if self.single_device is not None:
            alone = self.single_device
            out["single_device"] = {
                "parameter_bytes": alone.parameter_bytes,
                "buffer_bytes": alone.buffer_bytes,
                "gradient_bytes": alone.gradient_bytes,
                "optimizer_bytes": alone.optimizer_bytes,
                "peak_bytes": alone.peak_bytes,
            }
        return out


def step_notes(optimizer: str, autocast: str, updated: bool = True) -> tuple[str, ...]:
    """What a simulated step did differently from a real one, in sentences (PerRank.notes)."""
    notes = []
    if autocast != "none":
        notes.append(f"torch.autocast({autocast}) cast by CPU autocast's lists of ops (the simulation's tensors are "
                     "CPU tensors), as the single-device capture does on a CPU machine; CUDA's lists differ for a few "
                     "ops.")
    if autocast == "float16":
        notes.append("float16: the loss was scaled by a GradScaler before backward; its unscale and finite check (a "
                     "value read) were not run, they divide the gradients in place and add one flag.")
    if not updated:
        notes.append(UPDATE_STOPPED.format(name=OPTIMIZER_NAMES[optimizer]))
    return tuple(notes)


def attention_notes(config: ModelConfig | None, parallel: ParallelConfig) -> tuple[str, ...]:
    """Which attention kernel a float32 step with grouped key/value heads ran, where a CUDA GPU and this machine differ
    (graphviz_core.capture.meta_kernels.cuda_attention); none under context parallel (the ring's kernel either way)."""
    from graphviz_core.parallel.memory import mirrors_cuda

    if config is None or parallel.cp > 1 or config.attention != "sdpa":
        return ()
    if not (0 < config.kv_heads < config.heads and config.dtype == "float32" and config.autocast == "none"):
        return ()
    if mirrors_cuda():
        return ("Attention ran as a CUDA GPU runs it: float32 attention with grouped key/value heads takes torch's math "
                "path (its memory-efficient kernel takes no grouped heads), which keeps each layer's attention weights, "
                "and the GPU's softmax kernels' own memory is counted.",)
    return ("Attention ran this machine's fused kernel, as the single-device capture does here; a CUDA GPU runs float32 "
            "attention with grouped key/value heads on torch's math path and keeps each layer's attention weights "
            "too: batch x this rank's query heads x sequence x sequence x 4 B a layer more.",)


# Said in the figures' notes when the optimizer's update reads a value, which fake tensors do not have.
UPDATE_STOPPED = ("{name}'s update reads a value (Adafactor: the parameter's norm, .item()), which the simulation's "
                  "fake tensors do not have: its state is the one torch.optim built (_init_group, the shapes and dtypes "
                  "a real step gives), and the update's own temporaries are left out of the optimizer phase.")


def nodes_by_category(*roots: torch.Tensor) -> dict[str, int]:
    """The backward graph behind `roots` (rank 0's loss; a pipeline stage's output), node count per category (the
    graph explorer's categories), each node once."""
    from collections import Counter

    from graphviz_core.capture.walk import autograd_nodes
    from graphviz_core.graph.categories import category_of, normalise_op

    nodes = autograd_nodes(*(root.grad_fn for root in roots))
    counts = Counter(category_of(normalise_op(node.name())) for node in nodes)
    return dict(sorted(counts.items()))


@dataclass(frozen=True)
class StageReport:
    """One pipeline stage: what it holds, what it sends, and how many microbatches it keeps alive at most."""

    stage: int
    rank: int  # the pipeline rank holding it (its coordinate on the mesh's pp dimension)
    layers: tuple[int, int]  # first layer, one past the last (the model's numbering)
    embedding: bool  # holds the token embedding (the first stage)
    head: bool  # holds the final norm, the head and the loss (the last stage)
    parameter_bytes: int  # this stage's parameters on one of its ranks (sharded by the strategy)
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes_per_microbatch: int  # what one microbatch's forward (and the loss, last stage) leaves alive
    microbatches_in_flight_at_peak: int  # from the schedule's actions: forwards run whose backward has not
    microbatches_held_at_measured_peak: int  # the same count, as run, at the op where the rank's memory peaked
    peak_bytes: int  # the most bytes live on the rank holding this stage (all its stages), measured
    send_bytes: int  # per step: activations sent to the next stage and gradients to the previous one
    recv_bytes: int
    forward_flops_per_microbatch: int
    backward_flops_per_microbatch: int  # recomputation under checkpointing included

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["layers"] = self.layers[1] - self.layers[0]
        out["first_layer"], out["last_layer"] = self.layers[0], self.layers[1] - 1
        return out


@dataclass(frozen=True)
class PipelineReport:
    """One step of the whole pipeline: every stage, the schedule's order of actions and its bubble."""

    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int
    microbatch_size: int
    per_stage: tuple[StageReport, ...]
    # pipeline rank -> its forwards and backwards in the order its runtime ran them, written as torch writes actions
    # ("0F3": stage 0, forward, microbatch 3; "2B0")
    order: dict[int, tuple[str, ...]]
    bubble_fraction: float  # idle share of the ranks' time in the schedule, actions timed by their measured FLOPs
    ranks: tuple[PerRank, ...] = field(repr=False)  # pipeline rank r's figures (its phases, collectives)
    order_note: str = ""  # where torch's own listing of the actions (schedule.pipeline_order) differs from `order`

    @property
    def send_bytes(self) -> int:
        return sum(s.send_bytes for s in self.per_stage)

    @property
    def peak_bytes(self) -> int:
        return max(s.peak_bytes for s in self.per_stage)

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule,
            "pp": self.pp,
            "stages": len(self.per_stage),
            "stages_per_rank": self.stages_per_rank,
            "microbatches": self.microbatches,
            "microbatch_size": self.microbatch_size,
            "bubble_fraction": self.bubble_fraction,
            "bubble": "idle share of the pipeline ranks' time when each runs the schedule's actions in order, each as "
            "soon as its input has arrived, a forward or backward taking time in proportion to its measured FLOPs "
            "(transfers not timed)",
            "send_bytes": self.send_bytes,
            "recv_bytes": sum(s.recv_bytes for s in self.per_stage),
            "peak_bytes": self.peak_bytes,
            "order": {str(rank): list(actions) for rank, actions in self.order.items()},
            "order_note": self.order_note,
        }


def per_rank_of(
    config: ModelConfig | None,
    parallel: ParallelConfig,
    *,
    rank: int,
    mesh: dict[str, int],
    parameter_count: int,
    peaks: PhasePeaks,
    collectives: tuple[Collective, ...],
    snapshot: dict,
    expected: Expectation,
    resharded: dict[str, bool],
    nodes: dict[str, int],
    optimizer: str,
    autocast: str,
    updated: bool,
    started: float,
    forward_end_activation_bytes: int = 0,
) -> PerRank:
    """One rank's figures from a step run under the trackers: each phase's peak as `peaks` kept it, what was alive at
    the end (`snapshot`, the memory tracker's, module buffers apart), the collectives it issued, its backward graph's
    nodes by category, and in `notes` what the simulation did differently from a real step."""
    phases = phase_memories(peaks)
    end = parts_of(snapshot)
    return PerRank(
        config=config,
        parallel=parallel,
        rank=rank,
        mesh=mesh,
        parameter_count=parameter_count,
        parameter_bytes=end["parameters"],
        buffer_bytes=buffers_of(snapshot),
        gradient_bytes=end["gradients"],
        optimizer_bytes=end["optimizer"],
        peak_bytes=max(p.peak_bytes for p in phases),
        phases=phases,
        timeline=downsample(peaks.samples),
        collectives=collectives,
        backward_nodes_by_category=nodes,
        expected=expected,
        single_device=None,
        simulate_s=time.perf_counter() - started,
        resharded_after_forward=resharded,
        flops_by_phase=dict(peaks.flops_by_phase),
        segment_peaks=dict(peaks.segment_peaks),
        forward_end_activation_bytes=forward_end_activation_bytes,
        optimizer=optimizer,
        autocast=autocast,
        notes=step_notes(optimizer, autocast, updated) + attention_notes(config, parallel),
    )
