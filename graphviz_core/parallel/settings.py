"""How a training step is spread over ranks: a frozen, validated `ParallelConfig` and its checks against a model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from graphviz_core.config import FAMILIES, MODELS, ModelConfig

# The cluster the planner and the collective times assume unless told otherwise: H100 SXM nodes of 8.
H100_FLOPS = 989.4e12  # dense BF16 FLOP/s per GPU (H100 SXM datasheet, without sparsity)
GPUS_PER_NODE = 8
NVLINK_BYTES_PER_S = 450e9  # per GPU each way inside a node: NVLink 4 (900 GB/s both ways)
INFINIBAND_BYTES_PER_S = 50e9  # per GPU each way between nodes: one 400 Gb/s NDR NIC per GPU

# none: one device (today's capture). ddp: every rank holds the whole model and all-reduces gradients
# (torch's `replicate`, DDP on FSDP2's engine). fsdp: FSDP2 `fully_shard` per transformer layer over
# every rank. hsdp: shard inside groups of `shard_group` ranks, replicate across groups. tp: Megatron
# column/row tensor parallelism over `tp` ranks. fsdp+tp: a 2-D mesh, FSDP across (world / tp) x TP inside.
STRATEGIES = ("none", "ddp", "fsdp", "hsdp", "tp", "fsdp+tp")
# none: parameters, gradients and compute in the model's dtype. bf16: FSDP2 keeps float32 sharded
# parameters (the master copy the optimizer updates) and all-gathers / computes in bfloat16, reducing
# gradients in bfloat16. bf16-fp32-reduce: the same, with gradients reduced in float32.
MIXED_PRECISIONS = ("none", "bf16", "bf16-fp32-reduce")
FSDP_STRATEGIES = ("fsdp", "hsdp", "fsdp+tp")
# Pipeline schedules (torch.distributed.pipelining): gpipe runs every microbatch's forward, then every backward;
# 1f1b alternates one forward and one backward once the pipeline is full; interleaved-1f1b gives each rank
# `stages_per_rank` stages (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters").
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
MAX_WORLD = 4096  # a 70B run at FSDP 64 x TP 8 is 512 ranks; 4096 keeps a typo from building huge meshes


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout of one training step; every field is checked on construction."""

    strategy: str = "none"
    world_size: int = 1  # ranks in total (GPUs)
    tp: int = 1  # tensor-parallel degree: ranks that split each layer's matmuls (tp, fsdp+tp)
    shard_group: int = 0  # hsdp: ranks that shard one copy of the model (typically one node's 8 GPUs)
    reshard_after_forward: bool = True  # FSDP: free gathered parameters after forward, gather again in backward
    mixed_precision: str = "none"
    pp: int = 1  # pipeline stages' ranks: the model's layers are split over `pp` groups of ranks
    microbatches: int = 1  # pipeline parallel: the batch (per data-parallel rank) is split into this many
    schedule: str = "1f1b"  # pipeline parallel: the order each rank runs its microbatches' forwards and backwards
    stages_per_rank: int = 1  # interleaved-1f1b: stages each pipeline rank holds (looped: rank r has r, r+pp, ...)
    # Context parallel (torch's context_parallel, ring attention): each of `cp` ranks holds s/cp of every sequence;
    # attention exchanges keys and values among them. The data-parallel wrapper spans data x context ranks, as
    # torchtitan's FSDP over its "dp_shard_cp" mesh does (the cp ranks' gradients are summed).
    cp: int = 1
    # Megatron sequence parallel inside tensor parallel (Korthikanti et al.): norms run on s/tp of the tokens, the
    # column-split projections all-gather their input, the row-split ones reduce-scatter their output.
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of: {', '.join(STRATEGIES)}.")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(
                f"unknown mixed precision {self.mixed_precision!r}; choose one of: {', '.join(MIXED_PRECISIONS)}."
            )
        # The degrees before what the CLI derives from them (world size tp x pp, microbatches pp x stages per rank):
        # `--pp 0` is reported as pp 0, not as world size 0, and `--stages-per-rank -1` not as microbatches -2
        for name in ("pp", "tp", "cp", "stages_per_rank", "world_size", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be a whole number >= 1, got {value!r}.")
        if not isinstance(self.shard_group, int) or isinstance(self.shard_group, bool) or self.shard_group < 0:
            raise ValueError(f"shard group must be a whole number >= 0, got {self.shard_group!r}.")
        if self.world_size > MAX_WORLD:
            raise ValueError(f"world size {self.world_size} is above the limit of {MAX_WORLD} ranks.")
        self._check_pipeline()
        self._check_context_and_sequence()
        # Inside one pipeline stage: the ranks that share it (all of them without pipeline parallelism).
        strategy, world, tp = self.strategy, self.world_size // self.pp, self.tp
        if strategy == "none" and world != 1:
            if self.pp > 1:
                raise ValueError(
                    f"strategy 'none' with pipeline parallel {self.pp} needs world size {self.pp} (one rank per stage), "
                    f"got {self.world_size}; pick a strategy to use the other ranks."
                )
            raise ValueError(f"strategy 'none' runs on one device; set world size 1 (got {world}) or pick a strategy.")
        if strategy != "none" and world < 2:
            if self.pp > 1:
                raise ValueError(f"strategy {strategy!r} needs at least 2 ranks in each pipeline stage; world size "
                                 f"{self.world_size} over {self.pp} stages leaves one rank per stage, so raise the world "
                                 f"size to {2 * self.pp} or more, or pick 'none' for one rank per stage.")
            raise ValueError(f"strategy {strategy!r} needs at least 2 ranks; raise the world size.")
        if strategy not in ("tp", "fsdp+tp") and tp != 1:
            raise ValueError(
                f"strategy {strategy!r} has no tensor parallelism; set TP degree 1 or pick 'tp' / 'fsdp+tp'."
            )
        if strategy == "tp" and tp != world:
            raise ValueError(f"strategy 'tp' splits every layer over all ranks; set TP degree = world size ({world}).")
        if strategy == "fsdp+tp":
            if tp < 2:
                raise ValueError("strategy 'fsdp+tp' needs a TP degree of at least 2 (TP 1 is plain 'fsdp').")
            if world % tp:
                raise ValueError(
                    f"world size {world} is not divisible by TP degree {tp}; the 2-D mesh is (world / TP) x TP."
                )
            if world // tp < 2:
                raise ValueError(f"world size {world} / TP {tp} leaves one FSDP rank; use strategy 'tp' or more ranks.")
        if strategy == "hsdp":
            if not 2 <= self.shard_group < world or world % self.shard_group:
                raise ValueError(
                    f"HSDP shards inside groups of ranks: the shard group ({self.shard_group}) must be at least 2, "
                    f"smaller than the world size ({world}) and divide it."
                )
        elif self.shard_group:
            raise ValueError("a shard group only applies to strategy 'hsdp'; leave it at 0.")
        if strategy not in FSDP_STRATEGIES and not self.reshard_after_forward:
            raise ValueError("reshard after forward is an FSDP option; leave it on for strategies without FSDP.")
        if strategy not in (*FSDP_STRATEGIES, "ddp") and self.mixed_precision != "none":
            raise ValueError(
                "mixed precision here is FSDP2's policy (ddp, fsdp, hsdp, fsdp+tp); set mixed precision to none for "
                "this strategy."
            )

    def _check_context_and_sequence(self) -> None:
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence parallel is on or off (true / false), got {self.sequence_parallel!r}.")
        if self.sequence_parallel and self.tp < 2:
            raise ValueError("sequence parallel splits the tokens over the tensor-parallel ranks; set a TP degree of "
                             "2 or more (strategy tp or fsdp+tp), or turn sequence parallel off.")
        if self.cp == 1:
            return
        if self.strategy not in ("ddp", "fsdp", "fsdp+tp"):
            raise ValueError(f"context parallel ranks must sum their gradients, which the data-parallel wrapper does "
                             f"over data x context ranks; pick strategy fsdp, ddp or fsdp+tp (got {self.strategy!r}).")
        if self.world_size % (self.pp * self.cp * self.tp):
            stages = f"pipeline {self.pp} x " if self.pp > 1 else ""
            raise ValueError(f"world size {self.world_size} is not divisible by {stages}context parallel {self.cp} x "
                             f"TP {self.tp}; the mesh is {'pipeline x ' if self.pp > 1 else ''}data x context x "
                             "tensor ranks.")

    def _check_pipeline(self) -> None:
        pp, micro = self.pp, self.microbatches
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of: {', '.join(SCHEDULES)}.")
        if pp == 1:
            if micro != 1 or self.schedule != "1f1b" or self.stages_per_rank != 1:
                raise ValueError("microbatches, a schedule and stages per rank apply to pipeline parallelism; "
                                 "set pp to 2 or more, or leave them at 1, 1f1b and 1.")
            return
        if self.world_size % pp:
            raise ValueError(f"world size {self.world_size} is not divisible by pipeline parallel {pp}; each stage "
                             "needs the same number of ranks.")
        interleaved = self.schedule == "interleaved-1f1b"
        if interleaved and self.stages_per_rank < 2:
            raise ValueError("interleaved-1f1b gives each rank several stages; set stages per rank to 2 or more.")
        if not interleaved and self.stages_per_rank != 1:
            raise ValueError(f"schedule {self.schedule!r} runs one stage per rank; set stages per rank to 1 or pick "
                             "interleaved-1f1b.")
        if self.schedule == "1f1b" and micro < pp:
            raise ValueError(f"1F1B needs at least as many microbatches as stages ({pp}), got {micro}; raise "
                             "microbatches or pick gpipe.")
        if interleaved:
            rounds = max(1, micro // pp)  # torch's ScheduleInterleaved1F1B: microbatches come in rounds of pp
            if micro % rounds:
                raise ValueError(f"interleaved-1f1b runs microbatches in rounds of {pp}; {micro} is not a multiple "
                                 f"of its {rounds} rounds, pick a multiple of {pp}.")

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp ranks times the stages each holds."""
        return self.pp * self.stages_per_rank

    @property
    def data_parallel(self) -> int:
        """Ranks that each see a different batch (everything but tensor, pipeline and context parallelism)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> ParallelConfig:
        return dataclasses.replace(self, **changes)


def families_declaring(declares) -> list[str]:
    """The offered families whose parallel plan (models.family.ParallelPlan) `declares` a layout, in MODELS' order:
    what a refusal offers instead, and what the page's help names."""
    return [m for m in MODELS if FAMILIES[m].offered and declares(FAMILIES[m].parallel)]


def check_parallel(config: ModelConfig, parallel: ParallelConfig) -> None:
    """Refuse, with one sentence, a layout this model cannot take."""
    if getattr(config, "compile", False):
        raise ValueError("the ranks are simulated running the step eagerly (torch.compile is not simulated over the "
                         "fake process group); turn torch.compile off to see what each rank holds.")
    if parallel.pp > 1:
        _check_pipeline(config, parallel)
    if parallel.cp > 1 or parallel.sequence_parallel:
        _check_sequence_split(config, parallel)
    if parallel.strategy == "none":
        return
    if config.dtype != "float32" and parallel.mixed_precision != "none":
        raise ValueError(
            f"mixed precision keeps float32 master parameters and computes in bfloat16; set dtype float32 "
            f"(got {config.dtype}) or mixed precision none."
        )
    family = config.family
    if parallel.strategy in FSDP_STRATEGIES and not family.shardable:
        raise ValueError(
            f"model {config.model!r} has no repeated layers to shard one by one; pick model gpt2 or mlp for FSDP."
        )
    tp = parallel.tp
    if tp == 1:
        return
    plan = family.parallel
    if not plan.tensor:
        # The families that declare a column / row split (models.family.ParallelPlan.tensor; Mixtral's attention is
        # split, its experts stay whole on every TP rank).
        known = ", ".join(families_declaring(lambda plan: plan.tensor))
        raise ValueError(f"tensor parallelism cannot split model {config.model!r}: {plan.no_tensor}. Pick one of: "
                         f"{known}.")
    if plan.split_heads and config.attention == "mha":
        raise ValueError(
            "tensor parallelism splits nn.Linear projections; attention 'mha' packs them inside "
            "nn.MultiheadAttention, so pick attention sdpa or manual."
        )
    if plan.split_heads and config.heads % tp:
        raise ValueError(
            f"{config.heads} attention heads are not divisible by TP degree {tp}; each rank needs whole heads."
        )
    kv_heads = config.kv_heads or config.heads  # grouped-query attention: K and V have their own head count
    if plan.split_heads and kv_heads % tp:
        raise ValueError(
            f"{kv_heads} key/value heads are not divisible by TP degree {tp}; each rank needs whole heads."
        )
    intermediate = config.intermediate or 4 * config.hidden
    if intermediate % tp:
        raise ValueError(f"MLP width {intermediate} is not divisible by TP degree {tp}.")


def _check_sequence_split(config: ModelConfig, parallel: ParallelConfig) -> None:
    """The model-side rules of context and sequence parallelism (graphviz_core.parallel.context)."""
    plan = config.family.parallel
    if parallel.cp > 1 and not plan.ring_attention:
        known = ", ".join(families_declaring(lambda plan: plan.ring_attention))
        raise ValueError(f"context parallel cannot split the tokens of model {config.model!r}: {plan.no_ring}. Pick "
                         f"one of: {known}.")
    if parallel.cp > 1 and plan.ring_window and config.seq > plan.ring_window:
        raise ValueError(f"context parallel runs attention as torch's ring, which takes no mask; past {plan.ring_window} "
                         f"tokens model {config.model!r}'s sliding-window layers need one, so pick a sequence of at most "
                         f"{plan.ring_window} (got {config.seq}).")
    if parallel.sequence_parallel and not plan.sequence:
        known = ", ".join(families_declaring(lambda plan: plan.sequence))
        raise ValueError(f"sequence parallel cannot split the tokens of model {config.model!r}: {plan.no_sequence}. "
                         f"Pick one of: {known}.")
    cp = parallel.cp
    if cp > 1 and config.attention != "sdpa":
        raise ValueError(f"context parallel replaces scaled_dot_product_attention with torch's ring attention; set "
                         f"attention sdpa (got {config.attention}).")
    if cp > 1 and config.seq % (2 * cp):
        raise ValueError(f"context parallel {cp} gives each rank two chunks of the sequence (torch's head-tail load "
                         f"balancing); the sequence {config.seq} must be a multiple of 2 x {cp} = {2 * cp}.")
    if parallel.sequence_parallel and (config.seq // cp) % parallel.tp:
        held = f"the {config.seq // cp} tokens each context rank holds" if cp > 1 else f"the {config.seq} tokens"
        raise ValueError(f"sequence parallel splits {held} over TP {parallel.tp}; pick a sequence that is a multiple "
                         f"of {cp * parallel.tp if cp > 1 else parallel.tp}.")


def _check_pipeline(config: ModelConfig, parallel: ParallelConfig) -> None:
    """The model-side rules of pipeline parallelism (graphviz_core.parallel.pipeline splits the model)."""
    plan = config.family.parallel
    if plan.stages is None:
        known = ", ".join(families_declaring(lambda plan: plan.stages is not None))
        raise ValueError(f"pipeline parallelism cannot split model {config.model!r}: {plan.no_stages}. Pick one "
                         f"of: {known}.")
    if config.layers < parallel.stages:
        raise ValueError(f"{parallel.stages} pipeline stages need at least {parallel.stages} layers, one each; the "
                         f"model has {config.layers}.")
    if config.batch % parallel.microbatches:
        raise ValueError(f"batch {config.batch} is not divisible into {parallel.microbatches} microbatches; pick a "
                         "batch that is a multiple of the microbatches (the batch is per data-parallel rank).")
