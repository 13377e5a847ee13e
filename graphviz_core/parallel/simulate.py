"""Simulates one training step of rank 0 under FSDP2 / DDP / tensor parallelism with torch's own distributed engine.

How (the recipe of torchtitan's memory estimator, scripts/estimate/estimation.py): torch's fake process group
stands in for N ranks inside this one process (collectives are issued and shaped as on a real cluster, no data
moves), the model is built on `meta`, wrapped with torch's own `fully_shard` / `replicate` /
`parallelize_module` over a `DeviceMesh`, then materialised as fake tensors (`FakeTensorMode`: shapes, dtypes
and storages, no bytes). `FSDPMemTracker` (torch.distributed._tools) classifies every live storage — sharded
and all-gathered parameters, gradients, optimizer state, activations, temporaries, all-gather and
reduce-scatter buffers — and a second observer (graphviz_core.parallel.collectives) records each collective. Every
rank runs the same program on equal shards, so rank 0 stands for all of them.

The fake process group is process-global state: one simulation at a time (a lock), and it is torn down after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakIdKeyDictionary

from graphviz_core.analysis.training_step import OPTIMIZER_STATES, STEP_COUNTERS, optimizer_state_bytes
from graphviz_core.capture import step_gate
from graphviz_core.capture.flop_formulas import op_info
from graphviz_core.capture.gc_pause import no_cyclic_gc
from graphviz_core.capture.instruments.optimizer import OPTIMIZER_NAMES, make_optimizer
from graphviz_core.capture.meta_kernels import GROUPED_MM, grouped_mm_on_meta
from graphviz_core.config import ModelConfig
from graphviz_core.models.registry import build_model, compute_loss, make_batch
from graphviz_core.models.teaching import TORCH_DTYPES
from graphviz_core.parallel import sequence
from graphviz_core.parallel.collectives import (
    GPUS_PER_NODE,
    INFINIBAND_BYTES_PER_S,
    NVLINK_BYTES_PER_S,
    Collective,
    CollectiveRecorder,
)
from graphviz_core.parallel.settings import FSDP_STRATEGIES, ParallelConfig, check_parallel

if TYPE_CHECKING:
    from graphviz_core.parallel.pipeline import PipelineReport

PHASES = ("forward", "backward", "optimizer")
INTERCONNECT = {
    "gpus_per_node": GPUS_PER_NODE,
    "nvlink_bytes_per_s": NVLINK_BYTES_PER_S,
    "infiniband_bytes_per_s": INFINIBAND_BYTES_PER_S,
}
TIMELINE_POINTS = 300  # enough for a chart; a 70B step issues ~10^5 ops

# Megatron-LM's split (Shoeybi et al. 2019, section 3): the first matmul of attention (Q, K, V) and of the MLP
# is split by output columns, the second by input rows, so each pair needs one all-reduce forward and one
# backward. Names cover this project's blocks and Hugging Face's Llama-style layers.
COLUMN_PARALLEL = ("qkv", "q_proj", "k_proj", "v_proj", "fc", "gate_proj", "up_proj")
ROW_PARALLEL = ("proj", "o_proj", "down_proj")

# FSDPMemTracker's / MemTracker's kinds of storage -> the parts this report names. Module buffers (BatchNorm's
# running statistics, rotary tables) are no part: as in the capture's memory figures, a peak leaves them out and they
# are reported on their own (PhaseMemory.buffer_bytes, PerRank.buffer_bytes; every rank holds them whole). The batch
# (input ids, targets) is in the activations, as the capture counts it.
BUFFER_KIND = "Buffer"
_KIND_OF = {
    "Sharded Param": "parameters",
    "Parameter": "parameters",
    "Unsharded Param": "gathered_parameters",
    "Sharded Grad": "gradients",
    "Gradient": "gradients",
    "Unsharded Grad": "unsharded_gradients",
    "OptState": "optimizer",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporaries",
    "All Gather": "communication_buffers",
    "Reduce Scatter": "communication_buffers",
    "Other": "temporaries",
}
PARTS = (
    "parameters",
    "gathered_parameters",
    "gradients",
    "unsharded_gradients",
    "optimizer",
    "activations",
    "temporaries",
    "communication_buffers",
)

_SIMULATION_LOCK = threading.Lock()


@dataclass(frozen=True)
class PhaseMemory:
    """Bytes live on rank 0 at the peak of one phase, part by part (they sum to peak_bytes); module buffers beside."""

    phase: str
    peak_bytes: int  # module buffers left out, as in every memory figure here
    parts_bytes: dict[str, int]  # PARTS -> bytes at that peak
    buffer_bytes: int = 0  # module buffers held beside that peak (not in peak_bytes)

    def to_dict(self) -> dict:
        """The JSON of one phase: the parts (summing to peak_bytes) and the buffers held beside them."""
        parts = {f"{k}_bytes": v for k, v in self.parts_bytes.items()}
        return {"peak_bytes": self.peak_bytes, "buffers_bytes": self.buffer_bytes, **parts}


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


@dataclass
class Workload:
    """What a simulation runs: a model built on meta, example inputs (made inside fake mode) and a loss."""

    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # (model input, targets)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    dtype: torch.dtype
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda model, x: model(x)
    optimizer: str = "adamw"  # the torch.optim optimizer the step runs (graphviz_core.config.OPTIMIZERS)
    autocast: str = "none"  # bfloat16 / float16: forward and loss under torch.autocast, as the capture runs them


def workload_of(config: ModelConfig) -> Workload:
    """The project's models (graphviz_core.models.teaching) as a simulation workload."""

    def build() -> nn.Module:
        with torch.device("meta"):
            return build_model(config)

    shapes = make_batch(config, "meta")  # shapes and dtypes only

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        # Called inside FakeTensorMode: zeros of the real batch's shapes are fake CPU tensors, no bytes.
        return (
            torch.zeros(shapes.inputs.shape, dtype=shapes.inputs.dtype),
            torch.zeros(shapes.targets.shape, dtype=shapes.targets.dtype),
        )

    return Workload(build, inputs, lambda out, targets: compute_loss(config, out, targets), TORCH_DTYPES[config.dtype],
                    optimizer=config.optimizer, autocast=config.autocast)


@contextlib.contextmanager
def autocast_region(autocast: str) -> Iterator[None]:
    """Around a forward and its loss: torch.autocast in `autocast` (none: nothing), as training and the capture
    (graphviz_core.capture.autocast) run them. The simulation's fake tensors say they live on the CPU, so CPU
    autocast's op lists decide what is cast, as in a capture on this machine; its cache of weight copies lives
    until the region ends, with the forward."""
    if autocast == "none":
        yield
        return
    from graphviz_core.capture.autocast import AUTOCAST_DTYPES

    with torch.autocast("cpu", dtype=AUTOCAST_DTYPES[autocast]):
        yield


def scaled_for_backward(loss: torch.Tensor, autocast: str) -> torch.Tensor:
    """float16 autocast: the loss multiplied by a GradScaler's scale before backward, as training does. The scaler's
    unscale and finite check (a value read, which fake tensors cannot give) are not run: they divide the gradients
    in place and allocate one flag, so the bytes are the same; the step then runs as a plain optimizer step."""
    if autocast != "float16":
        return loss
    return torch.amp.GradScaler(loss.device.type).scale(loss)


def simulate_parallel(
    config: ModelConfig, parallel: ParallelConfig, single_device: bool = True, layer_report: bool = True
) -> PerRank:
    """Rank 0's memory and collectives for one training step of `config` laid out as `parallel`: the config's
    optimizer (config.optimizer) stepped, its forward and loss under the config's autocast.

    `single_device` also simulates strategy none for comparison; `layer_report`, under context or sequence
    parallelism, measures one layer's activations on 1- and 2-layer copies (parallel.layer_activations). Raises
    ValueError for layouts the model cannot take.
    """
    check_parallel(config, parallel)
    workload = workload_of(config)
    result = simulate_workload(workload, parallel, config=config)
    if single_device and parallel.strategy != "none":
        alone = simulate_workload(workload, ParallelConfig(), config=config)
        result = _with_single_device(result, alone)
    if layer_report and (parallel.cp > 1 or parallel.sequence_parallel):
        from graphviz_core.parallel.layer_activations import layer_activations

        # One layer: the activations alive at the end of forward on a 2-layer copy minus a 1-layer one (embeddings,
        # final norm, head and logits cancel).
        ends = [
            simulate_parallel(config.replace(layers=n), parallel, single_device=False, layer_report=False)
            for n in (1, 2)
        ]
        measured = ends[1].forward_end_activation_bytes - ends[0].forward_end_activation_bytes
        report = layer_activations(config, parallel, measured, result.collectives)
        result = dataclasses.replace(result, layer_activations=report)
    return result


def _with_single_device(result: PerRank, alone: PerRank) -> PerRank:
    return dataclasses.replace(result, single_device=alone)


def simulate_workload(workload: Workload, parallel: ParallelConfig, config: ModelConfig | None = None) -> PerRank:
    """Run one fake training step of `workload` under `parallel` and read rank 0's figures."""
    with simulation_lock():
        started = time.perf_counter()
        with fake_world(parallel) as meshes:
            return measure_step(workload, parallel, meshes, config=config, started=started)


@contextlib.contextmanager
def simulation_lock() -> Iterator[None]:
    """The fake process group is process-global: one simulation at a time, in a process with no other group."""
    if not _SIMULATION_LOCK.acquire(timeout=600):
        raise ValueError("another parallel simulation has been running for 10 minutes; try again when it ends.")
    try:
        if dist.is_initialized():
            raise ValueError(
                "a torch.distributed process group is already running in this process; "
                "the simulation needs its own fake one."
            )
        with step_gate.shared(), _quiet(), _propagation_apart():  # never beside a compiled capture
            yield
    finally:
        _SIMULATION_LOCK.release()


def forget_sharding_decisions() -> None:
    """Empty DTensor's sharding caches where a request starts (one layout, one plan), so that it runs as the first
    simulation of a process does, whatever ran before it (empty_sharding_caches says why). Refilling them made a
    llama-tiny FSDP+TP request 2.52 s instead of 2.24 (gpt2-tiny FSDP: 1.81 instead of 1.76)."""
    with simulation_lock():  # never while another simulation reads them
        empty_sharding_caches()


def empty_sharding_caches() -> None:
    """Empty DTensor's sharding caches (Python and C++); the caller holds the simulation lock. A cached decision is
    keyed by a mesh that equals any later mesh of the same shape and names made in a thread with the same id, so a
    simulation could reuse decisions from an earlier, torn-down world: in fresh-clone runs the planner's PP 2 x CP 2
    peak read 3,295,760 and 3,292,792 B against 3,258,768, the second time in a process of its own (a pipeline's rank
    threads can be given the ids of threads finished since). A pipeline simulation empties them before its rank
    threads start. Older torch releases have no function for it; there they stay."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()


@contextlib.contextmanager
def _propagation_apart() -> Iterator[None]:
    """DTensor works out an op's output shape, on a cache miss, by running it on fake copies of its inputs under the
    active fake mode: the simulation's own, so the memory tracker counted those copies as this rank's memory (seen:
    the first fsdp+tp step with full checkpointing in a process peaked 30,848 bytes above every later one, llama-tiny).
    The tracker leaves out ops under another fake mode (MemTracker.__torch_dispatch__), so propagation gets one of its
    own while a simulation runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    own = FakeTensorMode(allow_non_fake_inputs=True)
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: own
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # FSDP2 and the module trackers warn about hooks on model outputs that are not tensors; harmless here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@contextlib.contextmanager
def fake_world(parallel: ParallelConfig, rank: int = 0) -> Iterator[dict]:
    """The fake process group for `parallel.world_size` ranks (we are `rank`) and the meshes the layout needs."""
    if parallel.world_size == 1:
        yield {}
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=parallel.world_size)
    try:
        yield build_meshes(parallel)
    finally:
        dist.destroy_process_group()


def build_meshes(parallel: ParallelConfig) -> dict:
    """The device meshes `parallel` needs, over the process group already initialised (fake or real).

    Built outside FakeTensorMode: a mesh's rank table is a real tensor (torchtitan builds them first too).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world, tp = parallel.world_size, parallel.tp
    if parallel.pp > 1:
        return _pipeline_meshes(parallel)
    if parallel.cp > 1:
        return _context_meshes(parallel)
    if parallel.strategy == "none":
        return {}
    if parallel.strategy == "fsdp+tp":
        # TP innermost: its ranks are neighbours (one node, NVLink); FSDP strides across nodes.
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        return {"dp": mesh["dp"], "tp": mesh["tp"], "root": mesh}
    if parallel.strategy == "tp":
        return {"tp": init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))}
    if parallel.strategy == "hsdp":
        shard = parallel.shard_group
        mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        return {"dp": mesh, "root": mesh}
    return {"dp": init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))}


def _context_meshes(parallel: ParallelConfig) -> dict:
    """Data x context (x tensor, innermost) as torchtitan lays its mesh out; FSDP / DDP run over data and context
    ranks flattened into one dimension (torchtitan's "dp_shard_cp"), since every context rank holds gradients of
    its own part of the sequence."""
    from torch.distributed.device_mesh import init_device_mesh

    cp, tp = parallel.cp, parallel.tp
    dims = {"dp": parallel.world_size // (cp * tp), "cp": cp}
    if tp > 1:
        dims["tp"] = tp
    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    meshes = {"root": mesh, "dp": mesh["dp", "cp"]._flatten("dp_cp"), "cp": mesh["cp"]}
    if tp > 1:
        meshes["tp"] = mesh["tp"]
    return meshes


def _pipeline_meshes(parallel: ParallelConfig) -> dict:
    """Pipeline stages outermost (as torchtitan orders its mesh: pp, then data parallel, then tp innermost), so each
    stage's ranks are neighbours; the strategy's meshes are slices of it. Context parallel adds its dimension between
    data and tensor ranks (torchtitan's pp, dp, cp, tp) and FSDP / DDP span data x context ranks, as without a
    pipeline (_context_meshes)."""
    from torch.distributed.device_mesh import init_device_mesh

    inner = parallel.world_size // parallel.pp
    strategy, tp, cp = parallel.strategy, parallel.tp, parallel.cp
    if cp > 1:
        dims = {"pp": parallel.pp, "dp": inner // (cp * tp), "cp": cp, **({"tp": tp} if tp > 1 else {})}
        mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
        meshes = {"pp": mesh["pp"], "root": mesh, "dp": mesh["dp", "cp"]._flatten("dp_cp"), "cp": mesh["cp"]}
        return {**meshes, "tp": mesh["tp"]} if tp > 1 else meshes
    if strategy == "fsdp+tp":
        dims = {"pp": parallel.pp, "dp": inner // tp, "tp": tp}
    elif strategy == "tp":
        dims = {"pp": parallel.pp, "tp": tp}
    elif strategy == "hsdp":
        dims = {"pp": parallel.pp, "replicate": inner // parallel.shard_group, "shard": parallel.shard_group}
    elif strategy == "none":
        dims = {"pp": parallel.pp}
    else:
        dims = {"pp": parallel.pp, "dp": inner}
    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    meshes = {"pp": mesh["pp"], "root": mesh}
    if strategy == "hsdp":
        meshes["dp"] = mesh["replicate", "shard"]
    elif "dp" in dims:
        meshes["dp"] = mesh["dp"]
    if "tp" in dims:
        meshes["tp"] = mesh["tp"]
    return meshes


def _layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP wraps one by one: the children of the longest nn.ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def tp_plan(layer: nn.Module, sequence_parallel: bool = False) -> dict:
    """Megatron column/row styles for the nn.Linear projections inside one layer. A projection peft wrapped with LoRA
    is split as peft splits one under transformers' tensor parallelism (peft's add_lora_tp_hooks_dtensor): the base
    layer as the projection; under a column split lora_B by columns too and lora_A whole on every rank, under a row
    split lora_A by rows (its (b, s, r) output all-reduced) and lora_B whole. Under sequence parallel that B reads
    this rank's tokens only: a replicated DTensor then, so that its gradient is summed over the ranks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for name, module in layer.named_modules():
        leaf = name.rpartition(".")[2]
        column, row = leaf in COLUMN_PARALLEL, leaf in ROW_PARALLEL
        if isinstance(module, nn.Linear) and (column or row):
            plan[name] = ColwiseParallel() if column else RowwiseParallel()
        elif (column or row) and isinstance(getattr(module, "base_layer", None), nn.Linear) and hasattr(module, "lora_A"):
            plan[f"{name}.base_layer"] = ColwiseParallel() if column else RowwiseParallel()
            for adapter in module.lora_A:
                plan[f"{name}.lora_A.{adapter}"] = _replicated_adapter() if column else RowwiseParallel()
                if column:  # under a row split lora_B stays a plain layer: its input is whole on every rank
                    plan[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
                elif sequence_parallel:
                    plan[f"{name}.lora_B.{adapter}"] = _replicated_adapter(tokens_split=True)
    return plan


def _replicated_adapter(tokens_split: bool = False):
    """The style of LoRA's A beside a column-split projection: whole on every tensor-parallel rank, a replicated
    DTensor like the block input it reads (a plain layer would meet that DTensor, and torch refuses mixed tensors).
    Its (b, s, r) output leaves as a local tensor, so that B's column split takes it back as replicated and backward
    all-reduces its gradient there, once (Megatron's f); A's weight gradient is then whole, not a partial sum that
    every optimizer op would all-reduce again. With `tokens_split`, B beside a row-split projection under sequence
    parallel: its input is this rank's tokens (a local tensor, taken as sharded on the sequence), so its weight
    gradient is a partial sum, as a sequence-parallel norm's is."""
    from torch.distributed.tensor import DTensor, Shard, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    def tokens(mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Shard(1)], run_check=False) for x in inputs)

    class ReplicatedAdapter(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            return distribute_module(module, device_mesh, input_fn=tokens if tokens_split else None,
                                     output_fn=lambda mod, out, mesh: out.to_local())

    return ReplicatedAdapter()


def _projection(name: str) -> str:
    """The projection a plan entry belongs to: `self_attn.q_proj` for `self_attn.q_proj.base_layer` or
    `self_attn.q_proj.lora_B.default` (peft's LoRA wrapper), the name itself otherwise."""
    parts = name.split(".")
    cut = next((i for i, part in enumerate(parts) if part == "base_layer" or part.startswith("lora_")), len(parts))
    return ".".join(parts[:cut])


def _column_parallel_parents(layer: nn.Module, plan: dict) -> list[nn.Module]:
    """The modules (attention, MLP) whose input feeds column-split projections."""
    parents = {_projection(name).rpartition(".")[0] for name, style in plan.items()
               if type(style).__name__ == "ColwiseParallel"}
    return [layer.get_submodule(name) for name in sorted(parents)]


def _replicated_input(block: nn.Module, sequence_parallel: bool = False):
    """Megatron's `f`: the block's input enters as one replicated DTensor shared by its column-split projections,
    so backward sums their partial input gradients and all-reduces them once per block. Without it each of
    q, k, v (or gate, up) converts the input itself and backward issues one all-reduce per projection.

    Hugging Face attention takes `hidden_states` by keyword; the other blocks take their input by position."""
    import inspect

    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput

    first = next(iter(inspect.signature(block.forward).parameters), "")
    if sequence_parallel:  # the input arrives sharded on the sequence: all-gathered here instead
        return sequence.gathered_input(block, keyword=first == "hidden_states")
    if first == "hidden_states":
        return PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        )
    return PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )


def apply_parallelism(
    model: nn.Module, parallel: ParallelConfig, meshes: dict, layers: list[nn.Module] | None = None
) -> list[nn.Module]:
    """Wrap `model` (its repeated `layers`, found when not given) as `parallel` says; returns the blocks whose input
    tensor parallelism converts."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    strategy = parallel.strategy
    layers = _layers(model) if layers is None else layers
    tp_blocks: list[nn.Module] = []
    if strategy in ("tp", "fsdp+tp"):
        frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        for layer in layers:
            plan = tp_plan(layer, parallel.sequence_parallel)
            if not plan:
                raise ValueError("tensor parallelism found no attention or MLP projections to split in this model.")
            parents = _column_parallel_parents(layer, plan)
            if parallel.sequence_parallel:
                plan = sequence.sequence_parallel_plan(layer, plan)
            parallelize_module(layer, meshes["tp"], plan)
            for block in parents:
                parallelize_module(block, meshes["tp"], _replicated_input(block, parallel.sequence_parallel))
                tp_blocks.append(block)
        if parallel.sequence_parallel:
            sequence.shard_between_layers(model, layers, meshes["tp"])
            _keep_frozen(model, frozen)
    mp = MixedPrecisionPolicy()
    if parallel.mixed_precision != "none":
        reduce = torch.float32 if parallel.mixed_precision == "bf16-fp32-reduce" else torch.bfloat16
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    if strategy in FSDP_STRATEGIES:
        for layer in layers:
            fully_shard(layer, mesh=meshes["dp"], reshard_after_forward=parallel.reshard_after_forward, mp_policy=mp)
        # The root (embeddings, final norm, head) as training scripts wrap it: torchtitan calls fully_shard(model)
        # without the argument, and FSDP2's default (None) then keeps the root unsharded after forward, since
        # backward needs its parameters first (FSDPState._lazy_init). Turning resharding off turns it off here too.
        fully_shard(model, mesh=meshes["dp"], reshard_after_forward=None if parallel.reshard_after_forward else False,
                    mp_policy=mp)
    elif strategy == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for layer in layers:
            replicate(layer, mesh=meshes["dp"], mp_policy=mp)
        replicate(model, mesh=meshes["dp"], mp_policy=mp)
    return tp_blocks


def _keep_frozen(model: nn.Module, frozen: set[str]) -> None:
    """Freeze again what --freeze froze: torch's SequenceParallel style re-registers a norm's weight as a new
    nn.Parameter without its requires_grad (style.py, _replicate_module_fn), so a frozen norm would train."""
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


def _group_names(meshes: dict) -> dict[str, str]:
    names = {}
    for key, mesh in meshes.items():
        if key == "root":
            continue
        for dim, dim_name in enumerate(mesh.mesh_dim_names):
            names[mesh.get_group(dim).group_name] = dim_name
    return names


class _Propagating(threading.local):
    active = False


_propagating = _Propagating()


def _quiet_propagation() -> None:
    """Ops DTensor runs to find an op's global output shape (the first time it meets each op: cached after) are not
    this rank's: counted, they added 23% to the first tensor-parallel run's forward FLOPs in a process (llama-tiny,
    TP 2, 4 layers: 9,125,440 vs 7,421,504 on every later run)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached
    if getattr(original, "quiet", False):
        return

    def quiet(self, op_schema):
        was, _propagating.active = _propagating.active, True
        try:
            return original(self, op_schema)
        finally:
            _propagating.active = was

    quiet.quiet = True
    ShardingPropagator._propagate_tensor_meta_non_cached = quiet


class _PhasePeaks(torch.utils._python_dispatch.TorchDispatchMode):
    """Reads the memory tracker's running breakdown after every op: per-phase peaks and a timeline; and counts each
    op's FLOPs (graphviz_core.capture.flop_formulas, the capture's registry) by phase, on this rank's local shapes."""

    def __init__(self, tracker, layers: list[nn.Module] = ()) -> None:
        super().__init__()
        _quiet_propagation()
        self.tracker = tracker
        self.layers = list(layers)  # this rank's repeated blocks, in order: the peak of each is kept apart
        self.segment_peaks: dict[str, int] = {}  # "{phase}/pre", "{phase}/layer {i}", "{phase}/post" -> most bytes
        self._layer_of: dict[str, int | None] = {}  # the module tracker's names -> position in `layers`
        self.phase = "forward"
        self.peaks: dict[str, tuple[int, dict]] = {}
        self.samples: list[tuple[str, int]] = []
        self.flops = 0  # running total
        self.flops_by_phase: dict[str, int] = {}

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:  # each (pipeline) action starts its stretch before any layer again
        self._phase, self._in_layers = name, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented
        if func is GROUPED_MM and is_fake(args[0]):  # a mixture of experts' GEMMs: the fake kernel refuses float32,
            # which the CPU kernel runs
            out = grouped_mm_on_meta(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        if _propagating.active:  # DTensor working out an op's global shape, not this rank's work
            return out
        formula, _ = op_info(func)
        if formula is not None:
            flops = int(formula(*args, out_val=out, **(kwargs or {})))
            self.flops += flops
            self.flops_by_phase[self.phase] = self.flops_by_phase.get(self.phase, 0) + flops
        self.observe()
        return out

    def observe(self) -> None:
        snapshot = self.tracker._curr_mem_snap  # the tracker's running per-device totals (read only)
        if not snapshot:
            return
        parts = next(iter(snapshot.values()))
        total = parts["Total"] - _buffers(parts)  # module buffers are reported beside the peaks, not in them
        self.samples.append((self.phase, total))
        if total > self.peaks.get(self.phase, (-1, {}))[0]:
            self.peaks[self.phase] = (total, dict(parts))
        if self.layers:
            key = f"{self.phase}/{self._segment()}"
            self.segment_peaks[key] = max(total, self.segment_peaks.get(key, 0))

    def _segment(self) -> str:
        """Where the step is: in a layer (by position), before the phase's (or pipeline action's) first layer, or
        after its last. Layers of one shape peak by the same rule, so the planner scales these by layer count."""
        names = self.tracker._mod_tracker.parents
        if any(name not in self._layer_of for name in names):
            known = self.tracker._mod_tracker._known_modules  # module -> the name `parents` uses
            position = {known[m]: i for i, m in enumerate(self.layers) if m in known}
            self._layer_of.update({name: position.get(name) for name in names})
        inside = [self._layer_of[name] for name in names if self._layer_of[name] is not None]
        if inside:
            self._in_layers = True
            return f"layer {inside[0]}"
        return "post" if self._in_layers else "pre"


def _tracker(model: nn.Module, optimizer, parallel: ParallelConfig):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if parallel.strategy in (*FSDP_STRATEGIES, "ddp"):
        tracker = FSDPMemTracker(model, optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    # After every op the tracker walks every module it has seen to update per-module peaks (deep-copying
    # snapshots): quadratic in model size, 4 minutes of a 70B one-device run. We read its running totals
    # ourselves (_PhasePeaks), so that bookkeeping is switched off; the storage accounting is untouched.
    tracker._update_peak_stats = lambda peak_state: None
    # MemTracker hooks the gradient of every parameter a module holds when the module first runs, and a frozen one
    # (LoRA's base weights, --freeze) refuses a hook; it gets no gradient to count either, so it is skipped.
    tracker._param_to_grad_hook_handles = _FrozenSkipped()
    return tracker


def _track_batch(tracker, *batch: torch.Tensor) -> None:
    """The batch (input ids, targets) is live all step and counted with the activations, as the capture counts it:
    FSDPMemTracker files it as inputs; the plain MemTracker (one device, tensor parallel) has no such kind and would
    not see it at all (made before tracking starts), so it is filed as activations there."""
    if hasattr(tracker, "track_inputs"):
        tracker.track_inputs(batch)
        return
    from torch.distributed._tools.mem_tracker import _MemRefType

    for tensor in batch:
        tracker._update_and_maybe_create_winfos(tensor, _MemRefType.ACT)


class _FrozenSkipped(WeakIdKeyDictionary):
    """MemTracker's parameter -> gradient-hook handles, answering "already hooked" for parameters without
    gradients (it installs hooks where `get` says None)."""

    def get(self, key, default=None):
        if isinstance(key, torch.Tensor) and not key.requires_grad:
            return ()  # not None: nothing stored, so nothing to remove on exit either
        return super().get(key, default)


def _parts(snapshot: dict) -> dict[str, int]:
    parts = dict.fromkeys(PARTS, 0)
    for kind, nbytes in snapshot.items():
        name = getattr(kind, "value", kind)
        if name not in ("Total", BUFFER_KIND):
            parts[_KIND_OF.get(name, "temporaries")] += nbytes
    return parts


def _buffers(snapshot: dict) -> int:
    """The module buffers' bytes in a tracker snapshot."""
    return sum(nbytes for kind, nbytes in snapshot.items() if getattr(kind, "value", kind) == BUFFER_KIND)


def measure_step(
    workload: Workload,
    parallel: ParallelConfig,
    meshes: dict,
    config: ModelConfig | None = None,
    started: float | None = None,
    fake: bool = True,
    on_allocations: Callable | None = None,
) -> PerRank:
    """One training step of `workload` (its optimizer, its autocast) on this rank, tracked: fake tensors (the simulation) or, with
    fake=False, real ones over a real process group (tests/test_parallel.py's gloo cross-check). `on_allocations`,
    if given, receives the step's storage allocations and frees in order (parallel.allocation_trace's Trace)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    started = time.perf_counter() if started is None else started
    model = workload.build()
    parameter_count = sum(p.numel() for p in model.parameters())
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sharded_tp_bytes = _tp_split_bytes(model) if parallel.tp > 1 else 0
    trained = _trained_figures(model, parallel)  # the parameters with gradients (LoRA's adapters; not --freeze's)
    # parallelize_module / fully_shard run on the meta model, outside fake mode (they slice the mesh's rank
    # tables, which fake mode cannot); the parameters become fake storages afterwards with to_empty.
    tp_blocks = apply_parallelism(model, parallel, meshes)
    module_names = {m: name for name, m in model.named_modules()}
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        _to_empty_keeping_ties(model)
        if not fake:
            _fill_small(model)
        model.train()
        optimizer = make_optimizer(workload.optimizer, list(model.parameters()))
        _warm_optimizer_state(model, optimizer)
        inputs, targets = workload.inputs()
        step, forward = _context_parallel_step(workload, parallel, meshes, inputs, targets)
        tracker = _tracker(model, optimizer, parallel)
        _track_batch(tracker, inputs, targets)
        recorder = CollectiveRecorder(_group_names(meshes))
        for module_tracker in (tracker._mod_tracker, recorder.modules):
            _this_thread_only(module_tracker)
        for block in tp_blocks:
            recorder.name_input_conversions(block, module_names[block])
        peaks = _PhasePeaks(tracker, _layers(model))
        allocations = _allocations(on_allocations, model, optimizer, inputs, targets)
        # The recorder goes first: FSDPMemTracker wraps each param group's hooks when it enters, and the
        # recorder's wrappers (on the class) must already be in place underneath.
        # GC paused, collected first: the trackers see a tensor freed when its storage's weak reference dies; by
        # reference counting alone that happens at the same op on every run, where a GC pass landing mid-step
        # would move frees (and the optimizer step's peak) between runs (torchtitan's estimator does the same).
        with step, recorder, tracker, allocations, peaks, no_cyclic_gc(collect_first=True):
            peaks.observe()
            with autocast_region(workload.autocast):
                out = forward(model, inputs)
                loss = workload.loss(out, targets)
            del out
            loss = scaled_for_backward(loss, workload.autocast)
            # What backward will read: every activation still alive once the loss exists (ids and targets included).
            forward_end = _parts(next(iter(tracker.get_tracker_snapshot("current").values())))["activations"]
            nodes_by_category = _nodes_by_category(loss)
            recorder.phase = peaks.phase = "backward"
            loss.backward()
            del loss
            recorder.phase = peaks.phase = "optimizer"
            allocations.mark("optimizer")  # where torch.optim would create its state on a first step
            updated = optimizer_step(optimizer)
            peaks.observe()
            snapshot = next(iter(tracker.get_tracker_snapshot("current").values()))
            end, end_buffers = _parts(snapshot), _buffers(snapshot)
            allocations.deliver(model, on_allocations)
    phases = phase_memories(peaks)
    expected = _expectation(parallel, whole_bytes, sharded_tp_bytes, *trained, optimizer=workload.optimizer)
    mesh_sizes = {}
    for key, mesh in meshes.items():
        if key != "root" or parallel.cp > 1:  # context parallel: data, context (and tensor) ranks, then their union
            mesh_sizes.update(zip(mesh.mesh_dim_names, mesh.mesh.shape, strict=True))
    return PerRank(
        config=config,
        parallel=parallel,
        rank=0,
        mesh=mesh_sizes,
        parameter_count=parameter_count,
        parameter_bytes=end["parameters"],
        buffer_bytes=end_buffers,
        gradient_bytes=end["gradients"],
        optimizer_bytes=end["optimizer"],
        peak_bytes=max(p.peak_bytes for p in phases),
        phases=phases,
        timeline=_downsample(peaks.samples),
        collectives=tuple(recorder.collectives),
        backward_nodes_by_category=nodes_by_category,
        expected=expected,
        single_device=None,
        simulate_s=time.perf_counter() - started,
        resharded_after_forward=_resharded_after_forward(model),
        flops_by_phase=dict(peaks.flops_by_phase),
        segment_peaks=dict(peaks.segment_peaks),
        forward_end_activation_bytes=forward_end,
        optimizer=workload.optimizer,
        autocast=workload.autocast,
        notes=step_notes(workload.optimizer, workload.autocast, updated),
    )


def phase_memories(peaks: _PhasePeaks) -> tuple[PhaseMemory, ...]:
    """Each phase's peak, part by part, as the step's observer kept it."""
    return tuple(
        PhaseMemory(phase, peaks.peaks[phase][0], _parts(peaks.peaks[phase][1]), _buffers(peaks.peaks[phase][1]))
        for phase in PHASES
        if phase in peaks.peaks
    )


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


def _tp_split_bytes(model: nn.Module, trained_only: bool = False) -> int:
    """Bytes that tensor parallelism splits: the planned projections' weights and the column-split biases (a
    row-split projection's bias is added after the all-reduce, so every TP rank keeps it whole)."""
    total = 0
    for layer in _layers(model):
        for name, style in tp_plan(layer).items():
            for pname, p in layer.get_submodule(name).named_parameters():
                if (trained_only and not p.requires_grad) or type(style).__name__ == "ReplicatedAdapter":
                    continue
                if pname == "weight" or type(style).__name__ == "ColwiseParallel":
                    total += p.numel() * p.element_size()
    return total


def _trained_figures(model: nn.Module, parallel: ParallelConfig) -> tuple[int, int, int]:
    """(bytes, bytes tensor parallelism splits, tensors) of the parameters that get gradients: all of them in full
    fine-tuning; LoRA's adapters, or all but --freeze's, otherwise."""
    trained = [p for p in model.parameters() if p.requires_grad]
    split = _tp_split_bytes(model, trained_only=True) if parallel.tp > 1 else 0
    return sum(p.numel() * p.element_size() for p in trained), split, len(trained)


def _allocations(on_allocations: Callable | None, model: nn.Module, optimizer, *batch):
    """The allocation recorder when a caller asked for the trace (off by default: it costs a weak reference per
    storage)."""
    from graphviz_core.parallel.allocation_trace import AllocationRecorder, NotRecording, step_tensors

    if on_allocations is None:
        return NotRecording()
    return AllocationRecorder(step_tensors(model, optimizer, *batch))


def _context_parallel_step(workload: Workload, parallel: ParallelConfig, meshes: dict, inputs, targets):
    """(a context to hold the step in, the forward to call). Under context parallelism torch's context_parallel
    cuts the ids, targets and positions to this rank's chunks in place (before tracking starts) and runs attention
    as its ring until the step ends; the model gets the positions its chunks hold."""
    step = contextlib.ExitStack()
    if parallel.cp == 1:
        return step, workload.forward
    from graphviz_core.parallel.context import sequence_sharded

    positions = torch.arange(inputs.shape[1]).expand(inputs.shape).contiguous()
    step.enter_context(sequence_sharded(meshes["cp"], [inputs, targets, positions]))
    return step, lambda model, x: model(x, position_ids=positions)


def _resharded_after_forward(model: nn.Module) -> dict[str, bool]:
    """Each FSDP unit's resharding as FSDP2 settled it in its lazy init (the root's default is decided there)."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out[name] = group.post_forward_mesh_info is not None
    return out


def _to_empty_keeping_ties(model: nn.Module) -> None:
    """`to_empty` replaces parameters module by module, which splits a tied pair (GPT-2's wte / lm_head) into
    two; tie them again so that the model holds one tensor, as the real one does."""
    tied: dict[int, list[tuple[nn.Module, str]]] = {}  # id(parameter) -> every (module, name) holding it
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            tied.setdefault(id(param), []).append((module, name))
    model.to_empty(device="cpu")
    for owners in tied.values():
        first_module, first_name = owners[0]
        for module, name in owners[1:]:
            setattr(module, name, getattr(first_module, first_name))


@torch.no_grad()
def _fill_small(model: nn.Module) -> None:
    """to_empty leaves real storages uninitialised; any finite values do for sizes and collectives."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        local.normal_(0.0, 0.02)


def _this_thread_only(module_tracker) -> None:
    """ModTracker's forward hooks are global to the process (register_module_forward_pre_hook): a capture running
    in another session's thread would have its modules, and through MemTracker's hooks their parameters, counted
    in this rank's memory. Keep the hooks to the simulating thread; dispatch modes are per thread already."""
    owner = threading.get_ident()
    for name in ("_fw_pre_hook", "_fw_post_hook"):
        hook = getattr(module_tracker, name)

        def guarded(*args, _hook=hook):
            if threading.get_ident() == owner:
                return _hook(*args)
            return None

        setattr(module_tracker, name, guarded)


def _nodes_by_category(*roots: torch.Tensor) -> dict[str, int]:
    """The backward graph behind `roots` (rank 0's loss; a pipeline stage's output), node count per category (the
    graph explorer's categories), each node once."""
    from collections import Counter

    from graphviz_core.capture.walk import autograd_nodes
    from graphviz_core.graph.categories import category_of, normalise_op

    nodes = autograd_nodes(*(root.grad_fn for root in roots))
    counts = Counter(category_of(normalise_op(node.name())) for node in nodes)
    return dict(sorted(counts.items()))


def _warm_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer creates its state (AdamW's two moments, SGD's momentum) at the first step; a steady-state step
    (the second and later) starts with it alive. One untracked step on zero gradients creates it, as torchtitan's
    estimator gets by measuring its second iteration."""
    for p in model.parameters():
        if p.requires_grad:  # frozen ones (LoRA's base weights, --freeze) get no gradient and no state
            p.grad = torch.zeros_like(p)
    optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)


# Said in the figures' notes when the optimizer's update reads a value, which fake tensors do not have.
UPDATE_STOPPED = ("{name}'s update reads a value (Adafactor: the parameter's norm, .item()), which the simulation's "
                  "fake tensors do not have: its state is the one torch.optim built (_init_group, the shapes and dtypes "
                  "a real step gives), and the update's own temporaries are left out of the optimizer phase.")


def optimizer_step(optimizer: torch.optim.Optimizer) -> bool:
    """One step; False where the update stopped at a value read on fake tensors (its state was built before it)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    try:
        optimizer.step()
        return True
    except DataDependentOutputException:
        return False


def _expectation(
    parallel: ParallelConfig,
    whole_bytes: int,
    tp_bytes: int,
    trained_bytes: int,
    trained_tp_bytes: int,
    tensors: int,
    optimizer: str = "adamw",
) -> Expectation:
    """Per-rank bytes if every sharded tensor split exactly evenly: the textbook division (no padding). Gradients
    and the optimizer's state follow the parameters that get gradients (`trained_*`), split the same way."""
    params, formula = _per_rank(parallel, whole_bytes, tp_bytes)
    trained, _ = _per_rank(parallel, trained_bytes, trained_tp_bytes)
    frozen = trained_bytes != whole_bytes
    # torch's Adam / AdamW keep two moments shaped and typed like each (sharded) parameter, plus a float32 scalar
    # `step` per parameter tensor; SGD with momentum one buffer, SGD none: the training step's rule
    # (optimizer_state_bytes, which counts Adafactor's step counts only). Gradients match the parameters they belong
    # to; frozen ones (LoRA's base weights, --freeze) have neither.
    grads = "gradients = the trained parameters, split alike" if frozen else "gradients = parameters"
    copies = OPTIMIZER_STATES[optimizer]
    terms = [f"{copies} x {'those' if frozen else 'parameters'}"] if copies else []
    if STEP_COUNTERS[optimizer]:
        terms.append(f"a 4-byte step for each of {tensors} {'trained ' if frozen else ''}tensors")
    state = " + ".join(terms) or "nothing"
    if optimizer == "adafactor":
        state += " (its row and column factors left out: a lower bound)"
    return Expectation(
        params,
        trained,
        optimizer_state_bytes(optimizer, trained, tensors),
        formula + f"; {grads}; {OPTIMIZER_NAMES[optimizer]} state = {state}",
    )


def _per_rank(parallel: ParallelConfig, whole_bytes: int, tp_bytes: int) -> tuple[int, str]:
    """Bytes of `whole_bytes` (`tp_bytes` of them in split projections) one rank holds, and how, in words."""
    strategy, world, tp = parallel.strategy, parallel.world_size, parallel.tp
    if strategy == "fsdp":
        params, formula = whole_bytes / world, f"parameters / {world} ranks"
    elif strategy == "hsdp":
        params, formula = (
            whole_bytes / parallel.shard_group,
            f"parameters / {parallel.shard_group} ranks per shard group",
        )
    elif strategy == "ddp":
        params, formula = whole_bytes, "every rank holds every parameter"
    elif strategy == "tp":
        params = tp_bytes / tp + (whole_bytes - tp_bytes)
        formula = f"split projections / {tp} + the rest (embeddings, norms, head, row-split biases) whole"
    elif strategy == "fsdp+tp":
        dp = world // tp
        params = (tp_bytes / tp + (whole_bytes - tp_bytes)) / dp
        formula = f"(split projections / TP {tp} + the rest) / FSDP {dp}"
    else:
        params, formula = whole_bytes, "one device holds everything"
    return int(params), formula


def _downsample(samples: list[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    if len(samples) <= TIMELINE_POINTS:
        return tuple(samples)
    step = len(samples) / TIMELINE_POINTS
    # Keep each window's maximum so that peaks survive the thinning.
    out = []
    for i in range(TIMELINE_POINTS):
        window = samples[int(i * step) : int((i + 1) * step)] or samples[-1:]
        out.append(max(window, key=lambda s: s[1]))
    return tuple(out)
