"""The planner: the layouts of a model on a cluster (data-shard x data-replicate x tensor x pipeline x context
parallel, checkpointing, microbatch size), each simulated, ranked by whether it fits and by an estimated speed. Tensor
parallel layouts run Megatron sequence parallel wherever the model takes it (as torchtitan always does with TP).

Each layout is simulated by the same engine as one layout on the page (graphviz_core.parallel.simulate and
.pipeline), on models of 3 and 4 layers per pipeline stage: the layers are all of one shape, so every figure (bytes
live at each peak, parameters, gradients, optimizer state, collective bytes per link, FLOPs per stage) grows by the
same amount with each layer, and the figure for L layers is f(3) + (L - 3) x (f(4) - f(3)). A phase's peak is kept
apart by where it happens (before the layers, in the first, second, second-last or last layer, after them), each
scaled on its own and the largest taken, so a peak that moves (the embedding's gather with few layers, the last
layer's activations with many) is still found. tests/test_planner.py checks the scaled figures against full
simulations of four layouts; a stage of 4 layers or fewer is simulated whole.

The step time is an estimate, labelled so: the FLOPs measured on each rank at the stated GPU rate, plus the bytes each
rank sends at the stated link rates, without overlap; pipeline layouts run their schedule's order with each action
timed by its FLOPs.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from graphviz_core.capture.admission import CaptureCancelled
from graphviz_core.config import ModelConfig
from graphviz_core.parallel.collectives import link_of
from graphviz_core.parallel.settings import (
    GPUS_PER_NODE,
    H100_FLOPS,
    INFINIBAND_BYTES_PER_S,
    MAX_WORLD,
    NVLINK_BYTES_PER_S,
    ParallelConfig,
    check_parallel,
)
from graphviz_core.units import finite_or_null, format_bytes

# H100 SXM: 989.4 TFLOP/s dense BF16 (NVIDIA H100 datasheet; 1979 with sparsity), 80 GB of HBM3 (the planner's
# --gpu-memory is the caller's), NVLink 4 at 450 GB/s each way, one 400 Gb/s NDR InfiniBand NIC per GPU = 50 GB/s.
H100_MEMORY_BYTES = 80 * 2**30
SAMPLE_LAYERS = (3, 4)  # layers per pipeline stage the scaled figures are measured at: the fewest with a first,
# a second, a second-last and a last layer (FSDP gathers the next layer while one runs: a layer between two others
# is the steady state)
Progress = Callable[[int, int, str], None]  # (layouts done, layouts planned, what just finished)
# Every size the planner reads has a ceiling, so that a typo (--gpus-per-node 2**63, a list of 10,000 degrees) gets a
# sentence instead of a loop that never ends. GPUs as the simulator's world (MAX_WORLD); the global batch as the Plan
# tab's field; memory up to 1 PiB per GPU; rates from a millionth of a modern GPU's to far beyond any.
MAX_GLOBAL_BATCH = 1 << 20
MAX_GPU_MEMORY_BYTES = 2**50
RATES = {  # field: (lowest, highest, unit), in the unit the field holds
    "gpu_flops": (1e6, 1e21, "FLOP/s"),
    "nvlink_bytes_per_s": (1e3, 1e15, "B/s"),
    "infiniband_bytes_per_s": (1e3, 1e15, "B/s"),
}
MAX_TRIED = 64  # distinct values in one list of things to try (degrees, microbatch sizes)
MAX_LAYOUTS = 2000  # layouts one plan may enumerate (each is one or two simulations)
MAX_JOBS = 256  # worker processes asked for; the plan starts no more than the machine's cores and its sample runs


@dataclass(frozen=True)
class Cluster:
    """The GPUs a plan is for, and the rates its step-time estimate assumes."""

    gpus: int
    gpu_memory_bytes: int = H100_MEMORY_BYTES
    gpus_per_node: int = GPUS_PER_NODE
    gpu_flops: float = H100_FLOPS  # per second, the model's dtype (dense)
    nvlink_bytes_per_s: float = NVLINK_BYTES_PER_S  # per GPU, each way, inside a node
    infiniband_bytes_per_s: float = INFINIBAND_BYTES_PER_S  # per GPU, each way, between nodes

    def __post_init__(self) -> None:
        highest = {"gpus": MAX_WORLD, "gpus_per_node": MAX_WORLD, "gpu_memory_bytes": MAX_GPU_MEMORY_BYTES}
        for name in ("gpus", "gpu_memory_bytes", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be a whole number >= 1, got {value!r}.")
            if value > highest[name]:
                raise ValueError(f"{name.replace('_', ' ')} {value:,} is above the planner's limit of "
                                 f"{highest[name]:,}.")
        for name in RATES:
            if problem := rate_problem(name, getattr(self, name)):
                raise ValueError(problem)
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ValueError(f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}; pick a multiple.")

    def link_rate(self, link: str) -> float:
        return self.nvlink_bytes_per_s if link == "NVLink" else self.infiniband_bytes_per_s


def rate_problem(name: str, value: object, words: str | None = None, scale: float = 1.0) -> str | None:
    """Why `value` (in units of `scale` x the field's own: 1e12 for TFLOP/s) is no rate the planner takes, or None: a
    finite number inside RATES' range (1e-320 TFLOP/s is above 0, and a step at it lasts longer than a float holds).
    `words` names the field as the caller shows it."""
    low, high, unit = RATES[name]
    words = words or name.replace("_", " ")
    shown = {1e12: "T", 1e9: "G"}.get(scale, "") + unit
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low <= value * scale <= high:
        return None
    return f"{words} takes a rate from {low / scale:g} to {high / scale:g} {shown}, got {value!r}."


@dataclass(frozen=True)
class Layout:
    """One way to lay a training step out on the cluster."""

    dp_shard: int  # ranks that shard the parameters (FSDP)
    dp_replicate: int  # copies of each shard (HSDP's replicas across nodes); 1 = plain FSDP
    tp: int
    pp: int
    checkpoint: str
    microbatch_size: int  # sequences per microbatch
    microbatches: int  # per pipeline step (1 without pipeline parallelism)
    accumulation: int  # steps accumulated per optimizer step, so that the global batch is served
    cp: int = 1  # context parallel: ranks that split each sequence (FSDP shards over data x context ranks)
    mixed_precision: str = "none"  # FSDP2's policy (bf16: float32 master shards, bfloat16 compute)
    # Megatron sequence parallel inside tensor parallel: on with TP wherever the model takes it, as torchtitan runs TP
    sequence_parallel: bool = False

    @property
    def gpus(self) -> int:
        return self.dp_shard * self.dp_replicate * self.tp * self.pp * self.cp

    def parallel(self) -> ParallelConfig:
        strategy = _strategy(self.dp_shard * self.cp, self.dp_replicate, self.tp)
        return ParallelConfig(
            strategy=strategy,
            world_size=self.gpus,
            tp=self.tp,
            shard_group=self.dp_shard if strategy == "hsdp" else 0,
            pp=self.pp,
            microbatches=self.microbatches,
            schedule="1f1b",
            cp=self.cp,
            mixed_precision=self.mixed_precision if self.dp_shard * self.cp * self.dp_replicate > 1 else "none",
            sequence_parallel=self.sequence_parallel,
        )

    def model(self, config: ModelConfig, layers: int | None = None) -> ModelConfig:
        """The config one simulated step of this layout runs: a (pipeline) step's batch, its checkpointing."""
        return config.replace(
            batch=self.microbatch_size * self.microbatches,
            checkpoint=self.checkpoint,
            layers=config.layers if layers is None else layers,
        )

    def mesh(self) -> dict[str, int]:
        return {"dp_shard": self.dp_shard, "dp_replicate": self.dp_replicate, "tp": self.tp, "pp": self.pp,
                "cp": self.cp}

    def label(self) -> str:
        parts = [f"FSDP {self.dp_shard}"] if self.dp_shard > 1 else []
        if self.dp_replicate > 1:
            parts.append(f"replicas {self.dp_replicate}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}" + (" + SP" if self.sequence_parallel else ""))
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        return (" x ".join(parts) or "one GPU") + f", {self.checkpoint}, microbatch {self.microbatch_size}"


def _strategy(dp_shard: int, dp_replicate: int, tp: int) -> str:
    if dp_replicate > 1:
        return "hsdp"
    if dp_shard == 1:
        return "tp" if tp > 1 else "none"
    return "fsdp+tp" if tp > 1 else "fsdp"


@dataclass(frozen=True)
class Figures:
    """What one step of a layout does, from its simulation (full or scaled): integers keyed by name.

    `peak/{rank}/{phase}`, `parameters/{rank}`, `gradients/{rank}`, `optimizer/{rank}`, `sent/{rank}/{link}` (bytes a
    rank sends per step, per link), `flops/{stage}/{F|B}` (per microbatch; without a pipeline the step's forward and
    backward), `transfers/{stage}` (pipeline sends). `rank` is the pipeline rank."""

    values: dict[str, int]
    order: dict[int, tuple[str, ...]] = field(default_factory=dict)  # the pipeline schedule's actions per rank

    def ranks(self) -> list[int]:
        return sorted({int(k.split("/")[1]) for k in self.values if k.startswith("peak/")})

    def peak(self, rank: int) -> int:
        return max(v for k, v in self.values.items() if k.startswith(f"peak/{rank}/"))

    def peak_rank(self) -> int:
        return max(self.ranks(), key=self.peak)


def figures_of(result, gpus_per_node: int = GPUS_PER_NODE) -> Figures:
    """A simulation's figures (a PerRank; with a pipeline, every pipeline rank it simulated), each collective's link
    found for nodes of `gpus_per_node`."""
    values: dict[str, int] = {}
    pipeline = result.pipeline
    ranks = list(pipeline.ranks) if pipeline else [result]
    rank_ids = sorted({s.rank for s in pipeline.per_stage}) if pipeline else [0]
    for rank, per_rank in zip(rank_ids, ranks, strict=True):
        for key, peak in _role_peaks(per_rank).items():
            values[f"peak/{rank}/{key}"] = peak
        values[f"parameters/{rank}"] = per_rank.parameter_bytes  # buffers apart, as in every view (docs/parallel.md)
        values[f"gradients/{rank}"] = per_rank.gradient_bytes
        values[f"optimizer/{rank}"] = per_rank.optimizer_bytes
        for c in per_rank.collectives:
            if c.kind not in ("send", "recv"):
                key = f"sent/{rank}/{link_of(list(c.ranks), gpus_per_node)}"
                values[key] = values.get(key, 0) + c.traffic_bytes
    if pipeline:
        for s in pipeline.per_stage:
            values[f"flops/{s.stage}/F"] = s.forward_flops_per_microbatch
            values[f"flops/{s.stage}/B"] = s.backward_flops_per_microbatch
            values[f"transfers/{s.stage}"] = s.send_bytes
        return Figures(values, dict(pipeline.order))
    values["flops/0/F"] = result.flops_by_phase.get("forward", 0)
    values["flops/0/B"] = result.flops_by_phase.get("backward", 0)
    return Figures(values)


def _role_peaks(per_rank) -> dict[str, int]:
    """Each phase's peak by where it happens: before the layers, in the first, second, second-last or last layer, or
    after them ("forward/second"). A layer between others peaks at a + b x its position, so its phase's peak is at one
    of the four; each of these grows by the same bytes per layer added, where a phase's own peak can move from the
    embedding's gather (few layers) to the last layer's activations (many)."""
    if not per_rank.segment_peaks:
        return {phase.phase: phase.peak_bytes for phase in per_rank.phases}
    layers = 1 + max((int(key.rpartition(" ")[2]) for key in per_rank.segment_peaks if "/layer " in key), default=-1)
    roles = {0: ["first"], 1: ["second"], layers - 2: ["second-last"], layers - 1: ["last"]}
    if layers == 3:  # the middle layer is both the second and the second-last
        roles[1] = ["second", "second-last"]
    out: dict[str, int] = {}
    for key, peak in per_rank.segment_peaks.items():
        phase, _, where = key.partition("/")
        names = roles.get(int(where.rpartition(" ")[2]), []) if where.startswith("layer ") else [where]
        for name in names:
            out[f"{phase}/{name}"] = max(peak, out.get(f"{phase}/{name}", 0))
    return out


def scaled(small: Figures, large: Figures, per_stage: int) -> Figures:
    """The figures at `per_stage` layers per stage from those at SAMPLE_LAYERS = (3, 4): f(3) + (L - 3)(f(4) - f(3))."""
    if set(small.values) != set(large.values):
        raise ValueError("the two sample runs measured different things; they cannot be scaled.")
    low, high = SAMPLE_LAYERS
    step = per_stage - low
    values = {k: small.values[k] + step * (large.values[k] - small.values[k]) // (high - low) for k in small.values}
    return Figures(values, large.order)


# ---- simulating one layout ------------------------------------------------------------------------------------


def simulation_ranks(layout: Layout, layers: int) -> list[int] | None:
    """The pipeline ranks simulated for a plan: the first (embedding, most microbatches in flight), one in the middle
    (its FLOPs stand for every middle stage: the same layers) and the last (head and loss). A middle rank holds no
    more than the first: the same layers, no embedding, fewer microbatches in flight under 1F1B. When the stages are
    uneven (`layers` not a multiple of pp: the earlier stages take one more, as `graph --pp` splits them) every rank
    is simulated, since the middle ranks differ."""
    if layout.pp == 1:
        return None
    if layers % layout.pp:
        return list(range(layout.pp))
    return sorted({0, min(1, layout.pp - 1), layout.pp - 1})


def simulate_sample(config: ModelConfig, layout: Layout, per_stage: int | None,
                    gpus_per_node: int = GPUS_PER_NODE) -> Figures:
    """One simulation of `layout`: with `per_stage` layers per stage (a sample; the model's layers left over by an
    uneven split stay on the first stages, one each), or the model's own (None: full, every pipeline rank).

    DTensor's sharding caches are emptied first, as at the start of every layout request (a pipeline simulation
    empties them itself): a decision cached in an earlier sample's world names that world's process groups, and a mesh
    of a later world can equal the earlier one (DeviceMesh compares ranks, layout, names and thread, not groups).
    Planned in one process, FSDP 2 x TP 2's tensor-parallel mesh equals TP 2 x CP 2's, and the later layout's step
    asked for a group that no longer existed ("Could not resolve the process group registered under the name 3")."""
    from graphviz_core.parallel.pipeline import simulate_pipeline
    from graphviz_core.parallel.simulate import simulate_parallel
    from graphviz_core.parallel.world import forget_sharding_decisions

    layers = None if per_stage is None else per_stage * layout.pp + config.layers % layout.pp
    model = layout.model(config, layers)
    parallel = layout.parallel()
    if layout.pp == 1:  # the step only: no one-device run beside it, no per-layer activation report
        forget_sharding_decisions()  # (a pipeline simulation empties them itself, before its rank threads start)
        return figures_of(simulate_parallel(model, parallel, single_device=False, layer_report=False), gpus_per_node)
    ranks = None if per_stage is None else simulation_ranks(layout, model.layers)
    report = simulate_pipeline(model, parallel, ranks=ranks)
    first = dataclasses.replace(report.ranks[0], pipeline=report)
    return figures_of(first, gpus_per_node)


def _sample_or_failure(config: ModelConfig, layout: Layout, per_stage: int, gpus_per_node: int,
                       worker: bool = False) -> Figures | str:
    """A sample run, or why it failed (one line): one layout torch cannot run must not end the whole plan."""
    import gc

    try:
        return simulate_sample(config, layout, per_stage, gpus_per_node)
    except CaptureCancelled:  # the whole plan stops: not one layout's failure
        raise
    except Exception as exc:  # noqa: BLE001 - reported as the layout's reason, in the plan's output
        text = str(exc).strip()
        return f"the simulation failed: {type(exc).__name__}" + (f": {text.splitlines()[0]}" if text else "")
    finally:
        if worker:  # a worker process of this plan only: what the next run's collection would walk again (torch,
            gc.collect()  # transformers) is set aside for good
            gc.freeze()


# ---- the estimate ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One layout, simulated (scaled from SAMPLE_LAYERS), with the estimate."""

    layout: Layout
    peak_bytes: int  # the busiest rank's
    fits: bool
    parameter_bytes: int  # of the busiest rank
    gradient_bytes: int
    optimizer_bytes: int
    collective_bytes_per_step: int  # what the busiest rank sends per optimizer step (accumulation included)
    compute_s: float
    communication_s: float
    bubble_fraction: float | None
    step_time_s: float
    tokens_per_s_per_gpu: float

    def to_dict(self) -> dict:
        layout = self.layout
        return {
            "mesh": layout.mesh(),
            "sequence_parallel": layout.sequence_parallel,
            "label": layout.label(),
            "checkpoint": layout.checkpoint,
            "microbatch_size": layout.microbatch_size,
            "microbatches": layout.microbatches,
            "accumulation": layout.accumulation,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "collective_bytes_per_step": self.collective_bytes_per_step,
            "bubble_fraction": self.bubble_fraction,
            "estimate": {
                "compute_s": self.compute_s,
                "communication_s": self.communication_s,
                "step_time_s": self.step_time_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            },
        }


def estimate(config: ModelConfig, layout: Layout, figures: Figures, cluster: Cluster, global_batch: int) -> Planned:
    """The layout's place in the ranking: its busiest rank's peak against the GPU's memory, and the step-time
    estimate from the measured FLOPs and bytes at the cluster's rates."""
    values = figures.values
    rank = figures.peak_rank()
    peak = figures.peak(rank)
    sent = {link: sum(v for k, v in values.items() if k.startswith("sent/") and k.endswith(link))
            for link in ("NVLink", "InfiniBand")}
    busiest_sent = max(sum(v for k, v in values.items() if k.startswith(f"sent/{r}/")) for r in figures.ranks())
    communication_s = layout.accumulation * max(
        sum(values.get(f"sent/{r}/{link}", 0) / cluster.link_rate(link) for link in sent) for r in figures.ranks())
    bubble = None
    if layout.pp == 1:
        compute_s = layout.accumulation * (values["flops/0/F"] + values["flops/0/B"]) / cluster.gpu_flops
    else:
        from graphviz_core.parallel.pipeline import bubble_fraction, pipeline_time

        costs = _stage_costs(values, layout, cluster)
        bubble = bubble_fraction(figures.order, costs)
        compute_s = layout.accumulation * pipeline_time(figures.order, costs)
        transfers = max(v for k, v in values.items() if k.startswith("transfers/"))
        # neighbouring stages' ranks are gpus / pp apart (pp is the outermost mesh dimension)
        link = "NVLink" if layout.gpus // layout.pp < cluster.gpus_per_node else "InfiniBand"
        communication_s += layout.accumulation * transfers / cluster.link_rate(link)
    step = compute_s + communication_s
    tokens = global_batch * config.seq
    return Planned(
        layout=layout,
        peak_bytes=peak,
        fits=peak <= cluster.gpu_memory_bytes,
        parameter_bytes=values[f"parameters/{rank}"],
        gradient_bytes=values[f"gradients/{rank}"],
        optimizer_bytes=values[f"optimizer/{rank}"],
        collective_bytes_per_step=layout.accumulation * busiest_sent,
        compute_s=compute_s,
        communication_s=communication_s,
        bubble_fraction=bubble,
        step_time_s=step,
        tokens_per_s_per_gpu=tokens / step / layout.gpus if step else 0.0,
    )


def _stage_costs(values: dict[str, int], layout: Layout, cluster: Cluster) -> dict[int, tuple[float, float]]:
    """Seconds per microbatch for each stage's forward and backward; a middle stage not simulated has the simulated
    middle stage's FLOPs (the same layers)."""
    costs = {}
    middle = min(1, layout.pp - 1)
    for stage in range(layout.pp):
        source = stage if f"flops/{stage}/F" in values else middle
        costs[stage] = (values[f"flops/{source}/F"] / cluster.gpu_flops, values[f"flops/{source}/B"] / cluster.gpu_flops)
    return costs


# ---- enumerating ----------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, found up to its square root."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def distinct(values: Iterable[int], what: str, highest: int) -> tuple[int, ...]:
    """`values` with repeats collapsed (first seen first), each a whole number from 1 to `highest`, at most
    MAX_TRIED of them; a sentence for anything else."""
    out: dict[int, None] = {}
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= highest:
            raise ValueError(f"{what} are whole numbers from 1 to {highest:,}, got {value!r}.")
        out[value] = None
        if len(out) > MAX_TRIED:
            raise ValueError(f"{what}: at most {MAX_TRIED} different values to try in one plan.")
    if not out:
        raise ValueError(f"{what}: give at least one value to try.")
    return tuple(out)


def meshes(config: ModelConfig, cluster: Cluster, pp_degrees: Iterable[int], cp_degrees: Iterable[int] = (1,),
           tp_degrees: Iterable[int] | None = None, cp_with_pp: bool = False,
           refused: list[dict] | None = None) -> list[tuple[int, int, int, int, int]]:
    """(dp_shard, dp_replicate, tp, pp, cp) meshes that respect the cluster: tensor parallelism inside a node (a power
    of two dividing its GPUs), pipeline stages of whole layers (as even as whole layers allow, as `graph --pp` splits
    them), context parallelism splitting each sequence (beside a pipeline only with `cp_with_pp`: each such layout is a
    pipeline simulation, about 6 s of CPU per sample for 70B), and data parallelism over the rest, either sharded over
    all of it (FSDP) or sharded inside a node and replicated across nodes (HSDP, without context parallelism).
    `tp_degrees` narrows tensor parallelism to those degrees (still inside a node). A degree asked for that the
    cluster cannot take is appended to `refused` with the reason (mesh: the degrees it names; checkpoint and
    microbatch size None: every one)."""
    out = []
    tp_degrees = tuple(tp_degrees) if tp_degrees else None

    def refuse(reason: str, **mesh: int) -> None:
        if refused is not None:
            refused.append({"mesh": mesh, "checkpoint": None, "microbatch_size": None, "reason": reason})

    node_tp = [d for d in _divisors(cluster.gpus_per_node) if not d & (d - 1)]
    for tp in tp_degrees or ():
        if tp not in node_tp:
            refuse(f"tensor parallel {tp} is not a power of 2 that divides the {cluster.gpus_per_node} GPUs of a node "
                   "(tensor parallelism stays inside a node)", tp=tp)
    for pp in pp_degrees:
        if cluster.gpus % pp:
            refuse(f"pipeline parallel {pp} does not divide the {cluster.gpus} GPUs into stages of equal ranks", pp=pp)
            continue
        for cp in cp_degrees:
            if cp > 1 and pp > 1 and not cp_with_pp:
                refuse("context parallel beside pipeline stages is tried only when asked (--cp-with-pp, or the Plan "
                       "tab's box): each such layout is a pipeline simulation", pp=pp, cp=cp)
                continue
            if (cluster.gpus // pp) % cp:
                refuse(f"context parallel {cp} does not divide the {cluster.gpus // pp} GPUs "
                       f"{'of each pipeline stage' if pp > 1 else 'in all'}", pp=pp, cp=cp)
                continue
            for tp in node_tp:
                if (tp_degrees and tp not in tp_degrees):
                    continue
                if (cluster.gpus // (pp * cp)) % tp:
                    if tp_degrees:
                        refuse(f"tensor parallel {tp} does not divide the {cluster.gpus // (pp * cp)} GPUs left "
                               f"beside pipeline {pp} x context parallel {cp}", tp=tp, pp=pp, cp=cp)
                    continue
                dp = cluster.gpus // (pp * cp * tp)
                shapes = [(dp, 1)]
                inside = cluster.gpus_per_node // tp  # data ranks that fit in one node beside tensor parallelism
                if tp == 1 and cp == 1 and 2 <= inside < dp and dp % inside == 0:  # the simulator has no HSDP x TP
                    shapes.append((inside, dp // inside))
                out.extend((shard, replicate, tp, pp, cp) for shard, replicate in shapes)
    return out


def layouts_of(config: ModelConfig, cluster: Cluster, global_batch: int, checkpoints: Iterable[str],
               microbatch_sizes: Iterable[int], pp_degrees: Iterable[int], cp_degrees: Iterable[int] = (1,),
               tp_degrees: Iterable[int] | None = None, mixed_precision: str = "none", cp_with_pp: bool = False,
               ) -> tuple[list[Layout], list[dict]]:
    """Every layout the cluster allows, and those refused with the reason (a model rule, a batch that does not
    divide)."""
    layouts: list[Layout] = []
    refused: list[dict] = []
    checkpoints = tuple(dict.fromkeys(checkpoints))  # a repeat collapses: each layout is planned once
    microbatch_sizes = distinct(microbatch_sizes, "microbatch sizes", MAX_GLOBAL_BATCH)
    pp_degrees = distinct(pp_degrees, "pipeline degrees", MAX_WORLD)
    cp_degrees = distinct(cp_degrees, "context-parallel degrees", MAX_WORLD)
    tp_degrees = distinct(tp_degrees, "tensor-parallel degrees", MAX_WORLD) if tp_degrees else None
    found = meshes(config, cluster, pp_degrees, cp_degrees, tp_degrees, cp_with_pp, refused)
    if len(found) * len(microbatch_sizes) * len(checkpoints) > MAX_LAYOUTS:
        raise ValueError(f"{len(found) * len(microbatch_sizes) * len(checkpoints):,} layouts to try is above the "
                         f"planner's limit of {MAX_LAYOUTS:,}; try fewer degrees, microbatch sizes or checkpointing "
                         "policies.")
    for shard, replicate, tp, pp, cp in found:
        dp = shard * replicate
        for size in microbatch_sizes:
            for policy in checkpoints:
                micro = 2 * pp if pp > 1 else 1  # a pipeline step runs 2 microbatches per stage
                local = global_batch // dp if global_batch % dp == 0 else 0
                layout = Layout(shard, replicate, tp, pp, policy, size, micro,
                                local // (size * micro) if local and local % (size * micro) == 0 else 0, cp,
                                mixed_precision)
                reason = None
                if not layout.accumulation:
                    reason = (f"the global batch {global_batch} does not split into {dp} data-parallel ranks x "
                              f"microbatches of {size} x {micro} per pipeline step")
                else:
                    layout, reason = _with_sequence_parallel(config, layout)
                if reason:
                    refused.append({"mesh": layout.mesh(), "checkpoint": policy, "microbatch_size": size,
                                    "reason": reason})
                else:
                    layouts.append(layout)
    return layouts, refused


def _with_sequence_parallel(config: ModelConfig, layout: Layout) -> tuple[Layout, str | None]:
    """(the layout, why the model cannot take it or None). With tensor parallel, sequence parallel is on wherever the
    model takes it (a Llama-style decoder, a sequence that splits over TP), as torchtitan always runs it; plain TP
    otherwise."""
    if layout.tp > 1:
        with_sp = dataclasses.replace(layout, sequence_parallel=True)
        try:
            check_parallel(with_sp.model(config), with_sp.parallel())
            return with_sp, None
        except ValueError:
            pass
    try:
        check_parallel(layout.model(config), layout.parallel())
    except ValueError as exc:
        return layout, str(exc)
    return layout, None


# ---- the plan -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    config: ModelConfig
    cluster: Cluster
    global_batch: int
    planned: tuple[Planned, ...]  # ranked: fitting layouts first, then by estimated tokens/s per GPU
    skipped: tuple[dict, ...]  # layouts not simulated, each with the reason: refused by a rule, or settled by another
    simulate_s: float

    def to_dict(self) -> dict:
        """The plan as JSON takes it: a figure that is not finite (a step at a rate so low its time overflows) is
        null, and `notes` names it."""
        notes: list[str] = []
        out = finite_or_null(self._dict(), notes)
        if notes:
            out["notes"] = [f"{', '.join(notes)}: not a finite number at these rates (too large for a float), written "
                            "as null."]
        return out

    def _dict(self) -> dict:
        return {
            "schema": 1,
            "cluster": dataclasses.asdict(self.cluster),
            "global_batch": self.global_batch,
            "seq": self.config.seq,
            "estimate": "estimated, not measured: each rank's FLOPs (counted in the simulation) at gpu_flops, plus "
            "the bytes it sends (ring volumes) at the link rates, without overlap; a pipeline runs its 1F1B schedule's "
            "order with each forward and backward timed by its FLOPs. Memory is simulated (torch's own FSDP, TP and "
            "pipelining over a fake process group), scaled from 3 and 4 layers per stage.",
            "layouts": [p.to_dict() for p in self.planned],
            "skipped": list(self.skipped),
            "simulate_s": self.simulate_s,
        }


def plan(config: ModelConfig, cluster: Cluster, global_batch: int, checkpoints: Iterable[str] = ("none", "full"),
         microbatch_sizes: Iterable[int] = (1,), pp_degrees: Iterable[int] = (1, 2), jobs: int = 2,
         progress: Progress | None = None, cp_degrees: Iterable[int] = (1,), tp_degrees: Iterable[int] | None = None,
         mixed_precision: str = "none", cp_with_pp: bool = False) -> Plan:
    """Enumerate, simulate (scaled from two small runs per layout) and rank the layouts of `config` on `cluster`.

    Within one mesh some layouts settle others without a run: when full checkpointing does not fit, nothing of that
    microbatch size or larger does; when no checkpointing fits, a selective policy only recomputes more; when a
    microbatch size does not fit with a policy, a larger one does not either. Those are listed as skipped, with why."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or not 1 <= global_batch <= MAX_GLOBAL_BATCH:
        raise ValueError(f"global batch must be a whole number from 1 to {MAX_GLOBAL_BATCH:,}, got {global_batch}.")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= MAX_JOBS:
        raise ValueError(f"jobs (worker processes) must be a whole number from 1 to {MAX_JOBS}, got {jobs!r}; the "
                         "plan starts no more than this machine's cores anyway.")
    if config.compile:
        raise ValueError("the planner simulates each layout's eager step (torch.compile is not simulated across "
                         "ranks); turn compile off to plan.")
    started = time.perf_counter()
    layouts, refused = layouts_of(config, cluster, global_batch, checkpoints, microbatch_sizes, pp_degrees, cp_degrees,
                                  tp_degrees, mixed_precision, cp_with_pp)
    if not layouts:
        raise ValueError(f"no layout of {config.model!r} fits the rules on {cluster.gpus} GPUs: "
                         f"{refused[0]['reason'] if refused else 'nothing to try'}.")
    search = _Search(config, cluster, global_batch, layouts)
    _simulate(search, jobs, progress)
    planned = ranked(search.planned.values())
    # in the order the layouts were enumerated, not the order they were settled in: with worker processes that
    # follows which simulation ends first, and the same plan listed its skipped layouts in two orders
    position = {layout: i for i, layout in enumerate(layouts)}
    skipped = refused + [{"mesh": layout.mesh(), "checkpoint": layout.checkpoint,
                          "microbatch_size": layout.microbatch_size, "reason": reason}
                         for layout, reason in sorted(search.skipped.items(), key=lambda item: position[item[0]])]
    return Plan(config, cluster, global_batch, tuple(planned), tuple(skipped), time.perf_counter() - started)


def ranked(planned: Iterable[Planned]) -> list[Planned]:
    """Fitting layouts first, then the fastest by the estimate (tokens/s per GPU), then the least memory."""
    return sorted(planned, key=lambda p: (not p.fits, -p.tokens_per_s_per_gpu, p.peak_bytes))


class _Search:
    """Which layouts are simulated, in what order, and which are settled by others' results."""

    def __init__(self, config: ModelConfig, cluster: Cluster, global_batch: int, layouts: list[Layout]) -> None:
        self.config, self.cluster, self.global_batch = config, cluster, global_batch
        self.layouts = list(dict.fromkeys(layouts))  # each once: `finished` counts the distinct layouts started
        self.planned: dict[Layout, Planned] = {}
        self.skipped: dict[Layout, str] = {}
        self.started: set[Layout] = set()

    def _find(self, like: Layout, **changes) -> Layout | None:
        wanted = dataclasses.replace(like, **changes)
        return next((lay for lay in self.layouts if (lay.mesh(), lay.checkpoint, lay.microbatch_size) ==
                     (wanted.mesh(), wanted.checkpoint, wanted.microbatch_size)), None)

    def _settled(self, layout: Layout | None) -> bool:
        return layout is None or layout in self.planned or layout in self.skipped

    def _depends_on(self, layout: Layout) -> list[Layout]:
        """The layouts of the same mesh whose results may settle this one."""
        found = []
        if layout.checkpoint != "full":
            found.append(self._find(layout, checkpoint="full"))
        if layout.checkpoint not in ("full", "none"):
            found.append(self._find(layout, checkpoint="none"))
        smaller = [lay.microbatch_size for lay in self.layouts
                   if lay.mesh() == layout.mesh() and lay.microbatch_size < layout.microbatch_size]
        if smaller:
            found.append(self._find(layout, microbatch_size=max(smaller)))
        return [lay for lay in found if lay is not None]

    def _reason(self, layout: Layout) -> str | None:
        memory = self.cluster.gpu_memory_bytes
        for other in self._depends_on(layout):
            if other in self.skipped and "does not fit" in self.skipped[other]:
                return self.skipped[other]
            result = self.planned.get(other)
            if result is None:
                continue
            if other.checkpoint == "full" and other.microbatch_size == layout.microbatch_size and not result.fits:
                return (f"does not fit: full checkpointing at microbatch {other.microbatch_size} already peaks at "
                        f"{result.peak_bytes:,} bytes, above the GPU's {memory:,}")
            if other.microbatch_size < layout.microbatch_size and not result.fits:
                return (f"does not fit: microbatch {other.microbatch_size} with {other.checkpoint} checkpointing "
                        f"already peaks at {result.peak_bytes:,} bytes, above the GPU's {memory:,}")
            if other.checkpoint == "none" and result.fits and other.microbatch_size == layout.microbatch_size:
                return f"no checkpointing fits already; {layout.checkpoint} would only recompute more"
        return None

    def ready(self) -> list[Layout]:
        """Layouts not started whose settling layouts are settled; those settled by a result are skipped here."""
        out = []
        for layout in self.layouts:
            if layout in self.started or not all(self._settled(d) for d in self._depends_on(layout)):
                continue
            self.started.add(layout)
            reason = self._reason(layout)
            if reason:
                self.skipped[layout] = reason
            else:
                out.append(layout)
        return out

    def samples(self, layout: Layout) -> tuple[int, ...]:
        """Layers per stage to simulate `layout` at: SAMPLE_LAYERS, or the stage itself when it is no larger (with an
        uneven split the first stages hold one more layer in each run: simulate_sample)."""
        per_stage = self.config.layers // layout.pp
        return SAMPLE_LAYERS if per_stage > max(SAMPLE_LAYERS) else (per_stage,)

    def done(self, layout: Layout, samples: tuple[Figures, ...]) -> Planned:
        figures = scaled(*samples, self.config.layers // layout.pp) if len(samples) == 2 else samples[0]
        self.planned[layout] = estimate(self.config, layout, figures, self.cluster, self.global_batch)
        return self.planned[layout]

    def finished(self) -> bool:
        return len(self.started) == len(self.layouts)


def worker_count(jobs: int, runs: int) -> int:
    """The worker processes a plan of `runs` sample runs starts when asked for `jobs`: no more than this machine's
    cores, nor than the runs there are."""
    return max(1, min(jobs, os.cpu_count() or 1, runs))


def _simulate(search: _Search, jobs: int, progress: Progress | None) -> None:
    """Both sample runs of every layout the search asks for: in forked worker processes where this process runs no
    other thread (the CLI), here otherwise (a server's threads may hold locks a fork would copy). A fork pool starts
    all its workers at once, so it gets `jobs` but never more than the machine's cores or the sample runs there are
    (`--jobs 1000` forked 1,000 processes for two layouts)."""
    config, node = search.config, search.cluster.gpus_per_node
    jobs = worker_count(jobs, sum(len(search.samples(layout)) for layout in search.layouts))
    results: dict[tuple[Layout, int], Figures] = {}

    def finished(layout: Layout, layers: int, figures: Figures | str) -> None:
        if isinstance(figures, str):
            search.skipped.setdefault(layout, figures)
            return
        results[layout, layers] = figures
        if layout not in search.skipped and all((layout, n) in results for n in search.samples(layout)):
            planned = search.done(layout, tuple(results[layout, n] for n in search.samples(layout)))
            if progress:
                fits = "fits" if planned.fits else "does not fit"
                progress(len(search.planned), len(search.layouts) - len(search.skipped),
                         f"{layout.label()}: peak {format_bytes(planned.peak_bytes)}, {fits}")

    if jobs > 1 and threading.active_count() == 1:
        import torch

        import graphviz_core.parallel.pipeline  # noqa: F401 - imported once here, not once in each worker
        from graphviz_core.models.registry import build_model

        with torch.device("meta"):  # shapes only: the family's transformers classes imported, no bytes
            build_model(config.replace(layers=1))
        context = multiprocessing.get_context("fork")
        try:
            with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
                pending: dict[Future, tuple[Layout, int]] = {}
                while True:
                    for layout in search.ready():
                        for layers in search.samples(layout):
                            future = pool.submit(_sample_or_failure, config, layout, layers, node, True)
                            pending[future] = (layout, layers)
                    if not pending:
                        break
                    ready, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in ready:
                        finished(*pending.pop(future), future.result())
        except (OSError, BrokenProcessPool) as exc:  # a fork refused (a process limit: BlockingIOError), a worker killed
            raise ValueError(f"the plan's {jobs} worker processes could not run ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else 'no message'}); try --jobs 1, which "
                             "simulates in this process.") from None
        return
    while not search.finished():
        for layout in search.ready():
            for layers in search.samples(layout):
                finished(layout, layers, _sample_or_failure(config, layout, layers, node))


_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920, '80GB' -> 80000000000, '1.5 TiB', '4096B'. The unit is required: a bare '80' read as
    80 bytes made every layout "not fit" without a word."""
    import re

    match = re.fullmatch(r"\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if match and not unit:
        raise ValueError(f"a memory size needs its unit: {text.strip()}GiB, {text.strip()}GB or {text.strip()}B "
                         f"(bytes), not {text!r} alone.")
    if not match or unit not in _BYTE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"a memory size is a positive number and a unit (80GiB, 80GB, 81920MiB), not {text!r}.")
    value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if not 1 <= value <= MAX_GPU_MEMORY_BYTES:
        raise ValueError(f"a memory size is from 1 B to {MAX_GPU_MEMORY_BYTES // 2**50} PiB per GPU, not {text!r}.")
    return value
