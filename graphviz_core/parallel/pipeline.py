"""Pipeline parallelism simulated with torch.distributed.pipelining: every stage's forward and backward run, rank by
rank, over the fake process group, in the order torch's schedule object runs them.

How: the model (a Hugging Face decoder) is split between layers into `pp x stages_per_rank` stages, as torchtitan
splits its models: the first stage keeps the token embedding, the last the final norm and head, each its slice of
the layers; a stage passes its hidden states on. For each pipeline rank in turn the fake process group is started
as that rank, the rank's stage modules are wrapped by the strategy (FSDP / TP / DDP over the rank's data-parallel and
tensor-parallel ranks), handed to `PipelineStage`, and the schedule (`ScheduleGPipe`, `Schedule1F1B`,
`ScheduleInterleaved1F1B`) runs one step on fake tensors under the memory tracker. Transfers between stages are
sends and receives on the fake group: issued with their real shapes, no data moves.

What each stage holds at its peak is measured; how many microbatches a stage holds at most is read from the
schedule's own list of actions (`schedule.pipeline_order`: each forward adds one, each backward frees one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from graphviz_core.capture.autocast import AUTOCAST_DTYPES
from graphviz_core.capture.gc_pause import no_cyclic_gc
from graphviz_core.capture.instruments.optimizer import make_optimizer
from graphviz_core.config import ModelConfig
from graphviz_core.models.family import ParallelPlan
from graphviz_core.models.registry import build_model, compute_loss
from graphviz_core.models.teaching import TORCH_DTYPES
from graphviz_core.parallel.blocks import attribute, replace_attribute
from graphviz_core.parallel.collectives import CollectiveRecorder
from graphviz_core.parallel.fsdp import resharded_after_forward
from graphviz_core.parallel.memory import PhasePeaks, gpu_attention, memory_tracker, parts_of
from graphviz_core.parallel.report import (
    Expectation,
    PerRank,
    PipelineReport,
    StageReport,
    nodes_by_category,
    per_rank_of,
)
from graphviz_core.parallel.settings import ParallelConfig, check_parallel
from graphviz_core.parallel.simulate import (
    apply_parallelism,
    autocast_region,
    hand_counted,
    optimizer_step,
    scaled_for_backward,
    simulate_parallel,
    simulate_workload,
    warm_optimizer_state,
    workload_of,
)
from graphviz_core.parallel.world import (
    empty_sharding_caches,
    fake_world,
    forget_sharding_decisions,
    group_names,
    mesh_sizes,
    simulation_lock,
    this_thread_only,
    to_empty_keeping_ties,
)

SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}


def simulate_layout(config: ModelConfig, parallel: ParallelConfig, single_device: bool = True) -> PerRank:
    """Rank 0's figures for `config` laid out as `parallel`; with pipeline parallelism, pipeline rank 0's, with every
    stage in `.pipeline`."""
    forget_sharding_decisions()
    if parallel.pp == 1:
        return simulate_parallel(config, parallel, single_device)
    check_parallel(config, parallel)
    report = simulate_pipeline(config, parallel)
    first = dataclasses.replace(report.ranks[0], pipeline=report)
    if (parallel.cp > 1 or parallel.sequence_parallel) and hand_counted(config):
        first = dataclasses.replace(first, layer_activations=stage_layer_activations(config, parallel))
    if single_device:
        first = dataclasses.replace(first, single_device=simulate_workload(workload_of(config), ParallelConfig(),
                                                                           config=config))
    return first


def stage_layer_activations(config: ModelConfig, parallel: ParallelConfig):
    """One layer's activations per microbatch on a rank of one stage under context / sequence parallelism: the stage's
    ranks laid out as `parallel` without its pipeline, one microbatch of sequences, on a 2-layer and a 1-layer copy
    (graphviz_core.parallel.layer_activations); the ring's exchange per layer and microbatch from the 2-layer run."""
    from graphviz_core.parallel.layer_activations import layer_activations

    stage = parallel.replace(world_size=parallel.world_size // parallel.pp, pp=1, microbatches=1, schedule="1f1b",
                             stages_per_rank=1)
    micro = config.replace(batch=config.batch // parallel.microbatches)
    ends = [simulate_parallel(micro.replace(layers=n), stage, single_device=False, layer_report=False) for n in (1, 2)]
    measured = ends[1].forward_end_activation_bytes - ends[0].forward_end_activation_bytes
    return layer_activations(micro.replace(layers=2), stage, measured, ends[1].collectives)


def stage_bounds(layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, as even as whole layers allow (the earlier stages take the extra ones)."""
    base, extra = divmod(layers, stages)
    bounds, start = [], 0
    for s in range(stages):
        end = start + base + (s < extra)
        bounds.append((start, end))
        start = end
    return bounds


def rank_stages(parallel: ParallelConfig, rank: int) -> list[int]:
    """The stages pipeline rank `rank` holds: looped, as torch's interleaved schedules expect (r, r + pp, ...)."""
    return [rank + v * parallel.pp for v in range(parallel.stages_per_rank)]


def simulate_pipeline(config: ModelConfig, parallel: ParallelConfig, ranks: Iterable[int] | None = None) -> PipelineReport:
    """Every pipeline rank's step (or only `ranks`), run one after the other, and the stages they hold."""
    check_parallel(config, parallel)
    ranks = list(range(parallel.pp)) if ranks is None else list(ranks)

    def run(rank: int) -> _RankRun:
        global_rank = rank * (parallel.world_size // parallel.pp)  # pp is the outermost mesh dimension
        with fake_world(parallel, rank=global_rank) as meshes:
            return _run_rank(config, parallel, meshes, rank)

    with simulation_lock():
        empty_sharding_caches()  # each rank's thread starts from none, whichever thread ids it is given
        runs = one_thread_each({rank: functools.partial(run, rank) for rank in ranks})
    listed = next(iter(runs.values())).listed
    # The ranks simulated: the order their runtime ran; any other (the planner simulates a few): torch's listing with
    # each stage's microbatches numbered in turn, as every schedule here runs them.
    order = {rank: runs[rank].executed if rank in runs else in_turn(actions) for rank, actions in listed.items()}
    per_stage = []
    for rank in ranks:
        per_stage.extend(runs[rank].stages)
    per_stage.sort(key=lambda s: s.stage)
    costs = {s.stage: (s.forward_flops_per_microbatch, s.backward_flops_per_microbatch) for s in per_stage}
    bubble = bubble_fraction(order, costs) if len(per_stage) == parallel.stages else float("nan")
    return PipelineReport(
        schedule=parallel.schedule,
        pp=parallel.pp,
        stages_per_rank=parallel.stages_per_rank,
        microbatches=parallel.microbatches,
        microbatch_size=config.batch // parallel.microbatches,
        per_stage=tuple(per_stage),
        order=order,
        bubble_fraction=bubble,
        ranks=tuple(runs[r].per_rank for r in ranks),
        order_note=listing_note(parallel.schedule, listed, order),
    )


def one_thread_each(jobs: dict) -> dict:
    """Run each job in a thread of its own, one after the other, and return their results by key.

    DTensor caches its sharding decisions by device mesh, and two meshes of one shape and names are equal whatever
    their rank and process groups, unless made in different live threads: a later pipeline rank would reuse a decision
    naming a process group of the earlier rank's world, torn down since. Every thread stays alive until all are done
    (a finished thread's id can be given to the next)."""
    results, errors = {}, {}
    release = threading.Event()
    threads = []

    def work(key, job, finished: threading.Event) -> None:
        try:
            results[key] = job()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread below
            errors[key] = exc
        finally:
            finished.set()
        release.wait()

    try:
        for key, job in jobs.items():
            finished = threading.Event()
            thread = threading.Thread(target=work, args=(key, job, finished), daemon=True)
            threads.append(thread)
            thread.start()
            finished.wait()
            if key in errors:
                raise errors[key]
    finally:
        release.set()
        for thread in threads:
            thread.join()
    return results


# ---- the order of actions --------------------------------------------------------------------------------------


def compute_actions(schedule) -> dict[int, tuple[str, ...]]:
    """The schedule's forwards and backwards per pipeline rank, as torch writes them (`0F3`: stage 0, forward,
    microbatch 3), idle slots and gradient reductions left out."""
    order = {}
    for rank, actions in schedule.pipeline_order.items():
        kept = [a for a in actions if a is not None and a.computation_type.value in ("F", "B", "I")]
        order[rank] = tuple(str(a) for a in kept)
    return order


def in_turn(actions: Iterable[str]) -> tuple[str, ...]:
    """`actions` with each stage's forwards (and backwards) numbered 0, 1, 2... in the order they come: how the
    runtime runs them, whatever microbatch a listing names."""
    seen: dict[tuple[int, str], int] = {}
    out = []
    for action in actions:
        stage, kind = _parse(action)
        micro = seen.get((stage, kind), 0)
        seen[stage, kind] = micro + 1
        out.append(f"{stage}{kind}{micro}")
    return tuple(out)


def listing_note(schedule: str, listed: dict[int, tuple[str, ...]], order: dict[int, tuple[str, ...]]) -> str:
    """One sentence naming the ranks whose actions torch's schedule object lists differently from how they ran (""
    when none does). torch's Schedule1F1B._get_pipeline_order numbers the last rank's forwards from 1 (1F1 ... 1F4 for
    microbatches 0-3); its runtime (Schedule1F1B._step_microbatches) runs F0 ... F3."""
    differ = [rank for rank in order if tuple(listed.get(rank, ())) != tuple(order[rank])]
    if not differ:
        return ""
    rank = differ[0]
    ran, named = order[rank], listed[rank]
    at = next((i for i, (a, b) in enumerate(zip(named, ran, strict=False)) if a != b), min(len(named), len(ran)))
    said = f"names {named[at]} as action {at + 1}" if at < len(named) else f"lists {len(named)} actions"
    which = f"rank {rank}: it" if len(differ) == 1 else f"ranks {', '.join(map(str, differ))}: for rank {rank} it"
    return (f"The order shown is the one each rank's runtime ran. torch's own listing of the {schedule} schedule "
            f"(schedule.pipeline_order) differs for {which} {said} where the runtime ran "
            f"{ran[at] if at < len(ran) else 'nothing more'}. Its microbatch numbers are off there; every stage still "
            "ran each microbatch's forward and backward once.")


def _parse(action: str) -> tuple[int, str]:
    """'12B3' -> (12, 'B')."""
    digits = len(action) - len(action.lstrip("0123456789"))
    return int(action[:digits]), action[digits]


def in_flight_at_peak(actions: Iterable[str], stage: int) -> int:
    """The most microbatches `stage` holds at once running `actions` in order: a forward keeps its activations
    until that microbatch's backward (B, or I: the input-gradient half of a split backward) frees them."""
    held = most = 0
    for action in actions:
        index, kind = _parse(action)
        if index != stage:
            continue
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def bubble_fraction(order: dict[int, tuple[str, ...]], costs: dict[int, tuple[float, float]]) -> float:
    """Idle share of the pipeline ranks' time: each rank runs its actions in the schedule's order, each as soon as
    its input is there (a stage's forward of microbatch m after the previous stage's; its backward after the next
    stage's, the last stage's after its own forward), taking `costs[stage]` = (forward, backward) time."""
    makespan, busy = _timeline(order, costs)
    return 1.0 - busy / (len(order) * makespan) if makespan else 0.0


def pipeline_time(order: dict[int, tuple[str, ...]], costs: dict[int, tuple[float, float]]) -> float:
    """How long the schedule takes from the first forward to the last backward, actions timed as in bubble_fraction."""
    return _timeline(order, costs)[0]


def _timeline(order: dict[int, tuple[str, ...]], costs: dict[int, tuple[float, float]]) -> tuple[float, float]:
    """(makespan, busy time summed over ranks). A stage's n-th forward (backward) is microbatch n: every schedule
    here runs a stage's microbatches in order (and torch's 1F1B order numbers the last rank's forwards from 1)."""
    last = max(costs)
    seen: dict[tuple[int, str], int] = {}
    queues = {}
    for rank, actions in order.items():
        queue = []
        for action in actions:
            stage, kind = _parse(action)
            kind = "F" if kind == "F" else "B"
            queue.append((stage, kind, seen.get((stage, kind), 0)))
            seen[stage, kind] = seen.get((stage, kind), 0) + 1
        queues[rank] = queue
    finished: dict[tuple[int, str, int], float] = {}
    clock = dict.fromkeys(order, 0.0)
    busy = 0.0
    position = dict.fromkeys(order, 0)
    remaining = sum(len(q) for q in queues.values())
    while remaining:
        progressed = False
        for rank, queue in queues.items():
            while position[rank] < len(queue):
                stage, kind, micro = queue[position[rank]]
                if kind == "F":
                    needs = (stage - 1, "F", micro) if stage > 0 else None
                else:
                    needs = (stage + 1, "B", micro) if stage < last else (stage, "F", micro)
                if needs is not None and needs not in finished:
                    break
                cost = costs[stage][0 if kind == "F" else 1]
                finished[stage, kind, micro] = clock[rank] = max(clock[rank], finished.get(needs, 0.0)) + cost
                busy += cost
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule's actions wait on each other; it cannot run.")
    return max(clock.values()), busy


# ---- one pipeline rank ------------------------------------------------------------------------------------------


class DecoderStage(nn.Module):
    """One stage of a Hugging Face causal decoder, cut where its family's plan says (models.family.StageSplit): the
    token embedding on the first stage, a slice of the layers, the final norm and the head on the last; between stages
    the hidden states (microbatch, seq, hidden) travel."""

    def __init__(self, model: nn.Module, plan: ParallelPlan, first: bool, autocast: str = "none") -> None:
        super().__init__()
        self.model = model
        # The family's plan with its parts named from this stage (its model sits at `model`): what the strategy
        # wraps and splits (parallel.simulate.apply_parallelism) finds them there.
        split = plan.stages
        self.plan = dataclasses.replace(plan, stages=dataclasses.replace(
            split, embedding=f"model.{split.embedding}", layers=f"model.{split.layers}", norm=f"model.{split.norm}",
            head=f"model.{split.head}", first_only=tuple(f"model.{path}" for path in split.first_only)))
        self.first = first
        # The module whose weight this stage shares with another stage (a head tied to the token embedding: the first
        # stage holds it as its embedding, the last as its head), or None; its gradient is summed across them.
        self.tied: str | None = None
        self.autocast = autocast  # bfloat16 / float16: the forward under torch.autocast (config.autocast)
        # Context or sequence parallel: the positions of the tokens this rank holds, (batch, tokens), rows alike. Under
        # context parallel they are this rank's two chunks (torch's load balancing); under sequence parallel a stage's
        # hidden states arrive on s/t tokens while attention (and its rotary table) runs on the whole sequence.
        self.positions: torch.Tensor | None = None

    @property
    def layers(self) -> nn.ModuleList:
        """This stage's layers (held by `model`, read through its path, not registered twice)."""
        return attribute(self, self.plan.stages.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        later = self.plan.stages.later_forward
        with autocast_region(self.autocast):
            if not self.first and later is not None:
                return later(self.model, x, self.positions)
            given = {"input_ids": x} if self.first else {"inputs_embeds": x}
            if self.positions is not None:
                given["position_ids"] = self.positions
            return self.model(**given, use_cache=False).logits  # last stage: (mb, s, V); the others: (mb, s, h)


def build_stage(config: ModelConfig, bounds: tuple[int, int], first: bool, last: bool) -> DecoderStage:
    """The stage module on meta: the whole model built, then cut down to its layers where the family's plan says
    (torchtitan's split)."""
    split = config.family.parallel.stages
    if split is None:
        raise ValueError(f"pipeline parallelism cannot split model {config.model!r}: {config.family.parallel.no_stages}.")
    with torch.device("meta"):
        model = build_model(config)
    # A head tied to the token embedding (GPT-2, or tied on): the first stage keeps the weight as its embedding, the
    # last as its head, each a copy of its own (Megatron-LM's layout); their gradients are summed once per step.
    tied = attribute(model, split.head).weight is attribute(model, split.embedding).weight
    replace_attribute(model, split.layers, nn.ModuleList(list(attribute(model, split.layers))[bounds[0]:bounds[1]]))
    if not first:
        replace_attribute(model, split.embedding, None)  # the hidden states arrive as inputs_embeds
        for path in split.first_only:
            replace_attribute(model, path, None)
    if not last:
        replace_attribute(model, split.norm, nn.Identity())
        replace_attribute(model, split.head, nn.Identity())  # `logits` are then the hidden states this stage passes on
    stage = DecoderStage(model, config.family.parallel, first, config.autocast)
    if tied and first != last:
        stage.tied = stage.plan.stages.embedding if first else stage.plan.stages.head
    return stage


@dataclass
class _RankRun:
    stages: list[StageReport]
    per_rank: PerRank
    listed: dict[int, tuple[str, ...]]  # every pipeline rank's actions as torch's schedule object lists them
    executed: tuple[str, ...]  # this rank's actions as its runtime ran them


class _Logits:
    """What the family's loss reads from a model's output."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def _schedule(parallel: ParallelConfig, stages: list, loss_fn):
    """torch's schedule for `stages`. The fake process group moves no data, so the warm-up vote (a tensor passed
    along the stages to agree on static or inferred shapes) would read zeros; every stage is given its shapes
    (input_args / output_args), which is what the vote settles on when all stages have them."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining import stage as pipelining_stage

    base = getattr(schedules, SCHEDULE_CLASSES[parallel.schedule])
    inference_mode = getattr(pipelining_stage, "InferenceMode", None)
    if inference_mode is None:  # a torch without the vote (2.11 on the H200 had neither): the given shapes serve
        Static = base
    else:

        class Static(base):
            def _warmup_p2p(self, stages, has_backward, p2p_done):
                for stage in stages:
                    stage._inference_mode = inference_mode.STATIC

    if parallel.schedule == "interleaved-1f1b":
        return Static(stages, parallel.microbatches, loss_fn=loss_fn)
    return Static(stages[0], parallel.microbatches, loss_fn=loss_fn)


def _loss(config: ModelConfig, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's loss, under the config's autocast as the forward was (float16: scaled, as a GradScaler does)."""
    with autocast_region(config.autocast):
        loss = compute_loss(config, _Logits(out), targets)
    return scaled_for_backward(loss, config.autocast)


def _stage_shapes(config: ModelConfig, parallel: ParallelConfig, first: bool, last: bool) -> tuple:
    """Example input and output of a stage for one microbatch (made inside fake mode)."""
    mb = config.batch // parallel.microbatches
    compute = torch.bfloat16 if parallel.mixed_precision != "none" else TORCH_DTYPES[config.dtype]
    # Under autocast the head's matmul gives logits in the autocast dtype; the residual stream between stages stays
    # in the weights' dtype (a float32 residual plus a 16-bit branch is float32).
    logits = AUTOCAST_DTYPES.get(config.autocast, compute)
    seq = config.seq // parallel.cp  # context parallel: this rank's s/C tokens, on every stage
    # Sequence parallel: between stages each tensor-parallel rank holds (and passes on) s/t of them.
    hidden = (mb, seq // parallel.tp if parallel.sequence_parallel else seq, config.hidden)  # (mb, s, h)
    # A received activation needs its gradient: backward sends it to the previous stage.
    inputs = torch.zeros(mb, seq, dtype=torch.long) if first else torch.zeros(hidden, dtype=compute).requires_grad_()
    outputs = torch.zeros((mb, seq, config.vocab) if last else hidden, dtype=logits if last else compute)
    outputs.requires_grad_()
    return inputs, outputs


def _run_rank(config: ModelConfig, parallel: ParallelConfig, meshes: dict, rank: int) -> _RankRun:
    """Pipeline rank `rank`'s step: its stages built and wrapped, the schedule run under the trackers."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining import PipelineStage

    started = time.perf_counter()
    sizes = mesh_sizes(meshes, parallel)  # read outside fake mode: a mesh's rank table is a real tensor
    stage_ids = rank_stages(parallel, rank)
    bounds = stage_bounds(config.layers, parallel.stages)
    last_stage = parallel.stages - 1
    modules = [build_stage(config, bounds[s], s == 0, s == last_stage) for s in stage_ids]
    for module in modules:
        apply_parallelism(module, parallel, meshes, module.plan, layers=list(module.layers))
    holder = nn.ModuleList(modules)
    names = group_names(meshes)
    tied = _tied_group(modules, meshes)
    if tied is not None:
        names[tied.group_name] = "embedding"
    with FakeTensorMode(allow_non_fake_inputs=True):
        for module in modules:
            to_empty_keeping_ties(module)
        holder.train()
        optimizer = make_optimizer(config.optimizer, list(holder.parameters()))
        warm_optimizer_state(holder, optimizer)
        stages = []
        for s, module in zip(stage_ids, modules, strict=True):
            example_in, example_out = _stage_shapes(config, parallel, s == 0, s == last_stage)
            stages.append(PipelineStage(module, s, parallel.stages, torch.device("cpu"), input_args=(example_in,),
                                        output_args=(example_out,), group=meshes["pp"].get_group()))
        schedule = _schedule(parallel, stages, functools.partial(_loss, config))
        tokens = torch.zeros(config.batch, config.seq, dtype=torch.long)  # (b, s): inputs and targets alike
        tracker = memory_tracker(modules[0], optimizer, parallel, holder=holder)
        recorder = CollectiveRecorder(names)
        for module_tracker in (tracker._mod_tracker, recorder.modules):
            this_thread_only(module_tracker)
        peaks = _PipelinePeaks(tracker, [layer for module in modules for layer in module.layers])
        log = _ActionLog(stages, peaks, recorder)
        step, positions = _sequence_split(parallel, meshes, tokens)  # entered at once: closed by the `with` below
        with step, recorder, tracker, _gathers_filed(tracker, holder), peaks, gpu_attention(parallel), \
                no_cyclic_gc(collect_first=True):
            if positions is not None:  # sliced here, tracked: the buffer counts with the step's inputs, as the tokens
                for module in modules:  # do when the schedule splits them, not as a microbatch's activations
                    module.positions = positions[: config.batch // parallel.microbatches]
            peaks.observe()
            args = (tokens,) if 0 in stage_ids else ()
            # As torchtitan steps it: the last stage keeps no microbatch outputs (logits) for the caller.
            schedule.step(*args, target=tokens if last_stage in stage_ids else None, return_outputs=False)
            _sum_tied_gradients(modules, tied)
            recorder.phase = peaks.phase = "optimizer"
            log.stop()
            updated = optimizer_step(optimizer)
            peaks.observe()
            snapshot = next(iter(tracker.get_tracker_snapshot("current").values()))
        nodes: dict[str, int] = {}  # one microbatch's backward graph on each of the rank's stages, summed
        for counts in log.graph_nodes.values():
            for category, count in counts.items():
                nodes[category] = nodes.get(category, 0) + count
        per_rank = _rank_figures(config, parallel, sizes, holder, peaks, recorder, snapshot, started, updated,
                                 dict(sorted(nodes.items())))
        executed = tuple(log.executed)
        reports = [
            _stage_report(config, parallel, s, rank, bounds[s], module, optimizer, log, executed, per_rank)
            for s, module in zip(stage_ids, modules, strict=True)
        ]
    return _RankRun(reports, per_rank, compute_actions(schedule), executed)


def _tied_group(modules: list[DecoderStage], meshes: dict):
    """The process group of the first and the last stage's ranks that hold this rank's place on the other dimensions
    (Megatron-LM's embedding group), when one of this rank's stages holds a tied weight; else None."""
    if not any(module.tied for module in modules):
        return None
    table = meshes["root"].mesh  # (pp, the other dimensions...): global ranks
    place = tuple((table == dist.get_rank()).nonzero()[0].tolist()[1:])
    return dist.new_group([int(table[0][place]), int(table[-1][place])])


def _sum_tied_gradients(modules: list[DecoderStage], group) -> None:
    """After the last backward: the gradient of a weight two stages share, summed across them (one all-reduce of
    this rank's part of it, as Megatron-LM's finalize_model_grads does for the word embeddings), so the first and
    the last stage take the same update."""
    for module in modules:
        if module.tied is None:
            continue
        grad = attribute(module, module.tied).weight.grad
        if grad is not None:
            dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=group)


def _sequence_split(parallel: ParallelConfig, meshes: dict, tokens: torch.Tensor):
    """(a context to hold the step in, the tokens' positions or None). Context parallel: torch's context_parallel cuts
    the tokens (inputs and targets alike) and their positions to this rank's two chunks in place, before tracking
    starts, and runs every stage's attention as its ring until the step ends. Context or sequence parallel: every
    stage is given the positions (DecoderStage.positions)."""
    step = contextlib.ExitStack()
    if parallel.cp == 1 and not parallel.sequence_parallel:
        return step, None
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape).contiguous()
    if parallel.cp > 1:
        from graphviz_core.parallel.context import sequence_sharded

        step.enter_context(sequence_sharded(meshes["cp"], [tokens, positions]))
    return step, positions


@contextlib.contextmanager
def _gathers_filed(tracker, holder: nn.Module):
    """File every stage's gathered parameters as gathered parameters when they are gathered, whoever gathers them.

    FSDPMemTracker files a storage once, when an op first makes it, by where it is made: in a forward, as activations;
    it re-files the gathered parameters only in FSDP's pre-forward hook. The interleaved schedule gathers each stage
    itself (its UNSHARD actions, FSDPModule.unshard) before the stage's first forward: the copy-out made the gathered
    parameters outside any hook, filed them as activations, and the stage's first forward then moved them to gathered
    parameters, which took them off the activations it had added (llama-tiny 4 layers, FSDP or DDP 4 x PP 2, stage 0:
    its 152,320 B per microbatch less its 279,040 B of gathered embedding and layer = -126,720 B). As the tracker
    wraps FSDP's pre_backward per param group, each group's wait_for_unshard (where every unshard's copy-out ends) is
    wrapped, for the step only, to file its parameters as the pre-forward hook does."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in holder.modules() if isinstance(m, FSDPModule)]
    groups = [g for g in groups if g is not None] if isinstance(tracker, FSDPMemTracker) else []

    def filed(group, wait):
        def wait_for_unshard(*args, **kwargs):
            copied_out = group._all_gather_result is not None  # an unshard is pending (else the wait does nothing)
            out = wait(*args, **kwargs)
            for fsdp_param in group.fsdp_params if copied_out else ():
                tracker._update_and_maybe_create_winfos(fsdp_param.unsharded_param, _FSDPRefType.UNSHARDED_PARAM)
            return out

        return wait_for_unshard

    for group in groups:
        group.wait_for_unshard = filed(group, group.wait_for_unshard)
    try:
        yield
    finally:
        for group in groups:
            del group.wait_for_unshard  # the class's method again


class _PipelinePeaks(PhasePeaks):
    """The phase peaks and FLOPs (graphviz_core.parallel.memory) plus how many microbatches each stage held when
    the rank's memory peaked."""

    def __init__(self, tracker, layers: list[nn.Module] = ()) -> None:
        super().__init__(tracker, layers)
        self.held: dict[int, int] = {}  # stage -> microbatches whose forward has started and backward not ended
        self.held_at_peak: dict[int, int] = {}
        self.most = -1

    def observe(self, held: int = 0) -> None:
        super().observe(held)
        if self.samples and self.samples[-1][1] > self.most:
            self.most = self.samples[-1][1]
            self.held_at_peak = dict(self.held)


class _ActionLog:
    """Wraps each stage's forward_one_chunk / backward_one_chunk and its send / receive op lists: the phase the
    trackers file each action under, FLOPs per action, the microbatches each stage holds, what a stage's first forward
    leaves alive, and the bytes each stage sends and receives."""

    def __init__(self, stages: list, peaks: _PipelinePeaks, recorder: CollectiveRecorder) -> None:
        self.peaks, self.recorder = peaks, recorder
        self.flops_by: dict[tuple[int, str], int] = {}  # (stage, F | B) -> FLOPs over the step
        self.activations_before: dict[int, int] = {}  # stage -> activation bytes when its first forward began
        self.activation_per_microbatch: dict[int, int] = {}
        self.pending: int | None = None  # stage whose first forward ended; measured when the next action begins
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}
        self.executed: list[str] = []  # this rank's forwards and backwards as the runtime ran them ("1F0", "1B0")
        self.graph_nodes: dict[int, dict[str, int]] = {}  # stage -> its first microbatch's backward graph, by category
        for stage in stages:
            self._wrap(stage)

    def stop(self) -> None:
        self._settle()

    def _activations(self) -> int:
        snapshot = self.peaks.tracker._curr_mem_snap
        return parts_of(next(iter(snapshot.values())))["activations"] if snapshot else 0

    def _settle(self) -> None:
        """The stage whose first forward (and loss) just ended: what it left alive is one microbatch's activations."""
        if self.pending is not None:
            self.activation_per_microbatch[self.pending] = self._activations() - self.activations_before[self.pending]
            self.pending = None

    def _wrap(self, stage) -> None:
        index, peaks = stage.stage_index, self.peaks

        def timed(method, kind):
            def run(*args, **kwargs):
                self._settle()
                self.recorder.phase = peaks.phase = "forward" if kind == "F" else "backward"
                if kind == "F":
                    # torch's MemTracker refuses a root module's second forward (a second iteration, it assumes);
                    # a stage runs one forward per microbatch. Its per-module statistics are not read here.
                    peaks.tracker.memory_tracking.pop(stage.submod, None)
                first = kind == "F" and index not in self.activations_before
                if first:
                    self.activations_before[index] = self._activations()
                before = peaks.flops
                micro = args[0] if args else kwargs.get("fwd_chunk_id" if kind == "F" else "bwd_chunk_id")
                split = kind == "B" and not kwargs.get("full_backward", True)  # the input half of a split backward
                self.executed.append(f"{index}{'I' if split else kind}{micro}")
                if kind == "F":  # held from the moment its forward starts until its backward has ended
                    peaks.held[index] = peaks.held.get(index, 0) + 1
                out = method(*args, **kwargs)
                self.flops_by[index, kind] = self.flops_by.get((index, kind), 0) + peaks.flops - before
                if kind == "B":
                    peaks.held[index] -= 1
                if first:
                    self.pending = index
                    outputs = out if isinstance(out, (tuple, list)) else (out,)
                    self.graph_nodes[index] = nodes_by_category(*(t for t in outputs if isinstance(t, torch.Tensor)))
                return out

            return run

        def counted(method, tally):
            def ops(*args, **kwargs):
                found = method(*args, **kwargs)
                tally[index] = tally.get(index, 0) + sum(op.tensor.numel() * op.tensor.element_size() for op in found)
                return found

            return ops

        stage.forward_one_chunk = timed(stage.forward_one_chunk, "F")
        stage.backward_one_chunk = timed(stage.backward_one_chunk, "B")
        stage.get_fwd_send_ops = counted(stage.get_fwd_send_ops, self.sent)
        stage.get_bwd_send_ops = counted(stage.get_bwd_send_ops, self.sent)
        stage.get_fwd_recv_ops = counted(stage.get_fwd_recv_ops, self.received)
        stage.get_bwd_recv_ops = counted(stage.get_bwd_recv_ops, self.received)


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _stage_report(config, parallel, stage, rank, bounds, module, optimizer, log, actions, per_rank) -> StageReport:
    params = list(module.parameters())
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    micro = parallel.microbatches
    return StageReport(
        stage=stage,
        rank=rank,
        layers=bounds,
        embedding=stage == 0,
        head=stage == parallel.stages - 1,
        parameter_bytes=_tensor_bytes(params),
        gradient_bytes=_tensor_bytes(p.grad for p in params if p.grad is not None),
        optimizer_bytes=_tensor_bytes(state),
        activation_bytes_per_microbatch=log.activation_per_microbatch.get(stage, 0),
        microbatches_in_flight_at_peak=in_flight_at_peak(actions, stage),
        microbatches_held_at_measured_peak=log.peaks.held_at_peak.get(stage, 0),
        peak_bytes=per_rank.peak_bytes,
        send_bytes=log.sent.get(stage, 0),
        recv_bytes=log.received.get(stage, 0),
        forward_flops_per_microbatch=log.flops_by.get((stage, "F"), 0) // micro,
        backward_flops_per_microbatch=log.flops_by.get((stage, "B"), 0) // micro,
    )


def _rank_figures(config, parallel, sizes, holder, peaks, recorder, snapshot, started, updated, nodes) -> PerRank:
    """One pipeline rank's step as a PerRank: its phases, collectives (sends and receives included) and peak."""
    resharded = {}
    for module in holder:
        resharded.update(resharded_after_forward(module))
    stage_params = _tensor_bytes(holder.parameters())
    trained = _tensor_bytes(p for p in holder.parameters() if p.requires_grad)  # LoRA's adapters; not --freeze's
    expected = Expectation(stage_params, trained, parts_of(snapshot)["optimizer"],
                           "this rank's stages' parameters as torch sharded them (no closed form under pipelining)")
    figures = per_rank_of(config, parallel, rank=dist.get_rank() if dist.is_initialized() else 0, mesh=sizes,
                          parameter_count=sum(p.numel() for p in holder.parameters()), peaks=peaks,
                          collectives=tuple(recorder.collectives), snapshot=snapshot, expected=expected,
                          resharded=resharded, nodes=nodes, optimizer=config.optimizer, autocast=config.autocast,
                          updated=updated, started=started)
    if any(module.tied for module in holder):
        figures = dataclasses.replace(figures, notes=(*figures.notes, TIED_NOTE))
    return figures


# Said in a rank's notes when one of its stages holds a weight tied to another stage's.
TIED_NOTE = ("The model ties its head to the token embedding: the first stage holds the weight as its embedding and the "
             "last stage a copy as its head (Megatron-LM's layout), and after the backward one all-reduce between "
             "those two ranks (group `embedding`) sums their gradients, so both take the same update.")
