"""Simulates one training step of rank 0 under FSDP2 / HSDP / DDP / tensor / sequence / context parallelism with
torch's own distributed engine (pipeline parallelism: graphviz_core.parallel.pipeline, which runs its stages with the
same pieces).

How (the recipe of torchtitan's memory estimator, scripts/estimate/estimation.py): torch's fake process group
stands in for N ranks inside this one process (parallel.world: collectives are issued and shaped as on a real cluster,
no data moves), the model is built on `meta`, wrapped with torch's own `parallelize_module` (parallel.tensor) and
`fully_shard` / `replicate` (parallel.fsdp) over a `DeviceMesh`, then materialised as fake tensors
(`FakeTensorMode`: shapes, dtypes and storages, no bytes). torch's memory trackers classify every live storage
(parallel.memory) and a second observer records each collective (parallel.collectives); parallel.report builds the
figures. Every rank runs the same program on equal shards, so rank 0 stands for all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from graphviz_core.analysis.training_step import OPTIMIZER_STATES, STEP_COUNTERS, optimizer_state_bytes
from graphviz_core.capture.gc_pause import no_cyclic_gc
from graphviz_core.capture.instruments.optimizer import OPTIMIZER_NAMES, make_optimizer
from graphviz_core.config import ModelConfig
from graphviz_core.models.family import ParallelPlan
from graphviz_core.models.registry import build_model, compute_loss, make_batch
from graphviz_core.models.teaching import TORCH_DTYPES
from graphviz_core.parallel.blocks import repeated_layers
from graphviz_core.parallel.collectives import CollectiveRecorder
from graphviz_core.parallel.context import context_parallel_step
from graphviz_core.parallel.fsdp import apply_data_parallel, resharded_after_forward
from graphviz_core.parallel.memory import PhasePeaks, gpu_attention, memory_tracker, parts_of, track_batch
from graphviz_core.parallel.report import Expectation, PerRank, nodes_by_category, per_rank_of
from graphviz_core.parallel.settings import ParallelConfig, check_parallel
from graphviz_core.parallel.tensor import apply_tensor_parallel, tp_split_bytes
from graphviz_core.parallel.world import (
    fake_world,
    fill_small,
    group_names,
    mesh_sizes,
    simulation_lock,
    this_thread_only,
    to_empty_keeping_ties,
)


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
    plan: ParallelPlan = ParallelPlan()  # how the model's family says it splits (models.family.ParallelPlan)


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
                    optimizer=config.optimizer, autocast=config.autocast, plan=config.family.parallel)


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
    if layer_report and (parallel.cp > 1 or parallel.sequence_parallel) and hand_counted(config):
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


def hand_counted(config: ModelConfig) -> bool:
    """Whether one layer's activations under context / sequence parallel can stand beside a count by hand
    (parallel.layer_activations counts a Llama-style layer op by op); otherwise that report is left out."""
    return config.family.layer_memory_formula == "llama"


def _with_single_device(result: PerRank, alone: PerRank) -> PerRank:
    return dataclasses.replace(result, single_device=alone)


def simulate_workload(workload: Workload, parallel: ParallelConfig, config: ModelConfig | None = None) -> PerRank:
    """Run one fake training step of `workload` under `parallel` and read rank 0's figures."""
    with simulation_lock():
        started = time.perf_counter()
        with fake_world(parallel) as meshes:
            return measure_step(workload, parallel, meshes, config=config, started=started)


def apply_parallelism(
    model: nn.Module, parallel: ParallelConfig, meshes: dict, plan: ParallelPlan, layers: list[nn.Module] | None = None
) -> list[nn.Module]:
    """Wrap `model` (its repeated `layers`, found when not given) as `parallel` says: tensor (and sequence) parallel
    first, as the family's `plan` declares it, then FSDP / HSDP / DDP over the data-parallel mesh, as torchtitan
    composes them. Returns the blocks whose input tensor parallelism converts."""
    layers = repeated_layers(model) if layers is None else layers
    tensor = parallel.strategy in ("tp", "fsdp+tp")
    tp_blocks = apply_tensor_parallel(model, layers, parallel, meshes, plan) if tensor else []
    apply_data_parallel(model, layers, parallel, meshes)
    return tp_blocks


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
    sharded_tp_bytes = tp_split_bytes(model, workload.plan) if parallel.tp > 1 else 0
    trained = _trained_figures(model, parallel, workload.plan)  # the parameters with gradients (LoRA's adapters; not --freeze's)
    # parallelize_module / fully_shard run on the meta model, outside fake mode (they slice the mesh's rank
    # tables, which fake mode cannot); the parameters become fake storages afterwards with to_empty.
    tp_blocks = apply_parallelism(model, parallel, meshes, workload.plan)
    module_names = {m: name for name, m in model.named_modules()}
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        to_empty_keeping_ties(model)
        if not fake:
            fill_small(model)
        model.train()
        optimizer = make_optimizer(workload.optimizer, list(model.parameters()))
        warm_optimizer_state(model, optimizer)
        inputs, targets = workload.inputs()
        step, forward = context_parallel_step(workload, parallel, meshes, inputs, targets)
        tracker = memory_tracker(model, optimizer, parallel)
        track_batch(tracker, inputs, targets)
        recorder = CollectiveRecorder(group_names(meshes))
        for module_tracker in (tracker._mod_tracker, recorder.modules):
            this_thread_only(module_tracker)
        for block in tp_blocks:
            recorder.name_input_conversions(block, module_names[block])
        peaks = PhasePeaks(tracker, repeated_layers(model))
        allocations = _allocations(on_allocations, model, optimizer, inputs, targets)
        # The recorder goes first: FSDPMemTracker wraps each param group's hooks when it enters, and the
        # recorder's wrappers (on the class) must already be in place underneath.
        # GC paused, collected first: the trackers see a tensor freed when its storage's weak reference dies; by
        # reference counting alone that happens at the same op on every run, where a GC pass landing mid-step
        # would move frees (and the optimizer step's peak) between runs (torchtitan's estimator does the same).
        with step, recorder, tracker, allocations, peaks, gpu_attention(parallel), no_cyclic_gc(collect_first=True):
            peaks.observe()
            with autocast_region(workload.autocast):
                out = forward(model, inputs)
                loss = workload.loss(out, targets)
            del out
            loss = scaled_for_backward(loss, workload.autocast)
            # What backward will read: every activation still alive once the loss exists (ids and targets included).
            forward_end = parts_of(next(iter(tracker.get_tracker_snapshot("current").values())))["activations"]
            nodes = nodes_by_category(loss)
            recorder.phase = peaks.phase = "backward"
            loss.backward()
            recorder.phase = peaks.phase = "optimizer"
            allocations.mark("optimizer")  # where torch.optim would create its state on a first step
            updated = optimizer_step(optimizer)  # the loss still held, as a training loop's `loss` variable holds it
            peaks.observe()
            del loss
            snapshot = next(iter(tracker.get_tracker_snapshot("current").values()))
            allocations.deliver(model, on_allocations)
    expected = _expectation(parallel, whole_bytes, sharded_tp_bytes, *trained, optimizer=workload.optimizer)
    return per_rank_of(config, parallel, rank=0, mesh=mesh_sizes(meshes, parallel), parameter_count=parameter_count,
                       peaks=peaks, collectives=tuple(recorder.collectives), snapshot=snapshot, expected=expected,
                       resharded=resharded_after_forward(model), nodes=nodes, optimizer=workload.optimizer,
                       autocast=workload.autocast, updated=updated, started=started,
                       forward_end_activation_bytes=forward_end)


def _trained_figures(model: nn.Module, parallel: ParallelConfig, plan: ParallelPlan) -> tuple[int, int, int]:
    """(bytes, bytes tensor parallelism splits, tensors) of the parameters that get gradients: all of them in full
    fine-tuning; LoRA's adapters, or all but --freeze's, otherwise."""
    trained = [p for p in model.parameters() if p.requires_grad]
    split = tp_split_bytes(model, plan, trained_only=True) if parallel.tp > 1 else 0
    return sum(p.numel() * p.element_size() for p in trained), split, len(trained)


def _allocations(on_allocations: Callable | None, model: nn.Module, optimizer, *batch):
    """The allocation recorder when a caller asked for the trace (off by default: it costs a weak reference per
    storage)."""
    from graphviz_core.parallel.allocation_trace import AllocationRecorder, NotRecording, step_tensors

    if on_allocations is None:
        return NotRecording()
    return AllocationRecorder(step_tensors(model, optimizer, *batch))


def warm_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer creates its state (AdamW's two moments, SGD's momentum) at the first step; a steady-state step
    (the second and later) starts with it alive. One untracked step on zero gradients creates it, as torchtitan's
    estimator gets by measuring its second iteration."""
    for p in model.parameters():
        if p.requires_grad:  # frozen ones (LoRA's base weights, --freeze) get no gradient and no state
            p.grad = torch.zeros_like(p)
    optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)


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
