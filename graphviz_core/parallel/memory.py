"""The step's memory and FLOPs as rank 0 sees them: torch's memory trackers (`FSDPMemTracker` under FSDP / DDP,
`MemTracker` otherwise, torch.distributed._tools) classify every live storage, and a dispatch mode reads their running
totals after every op (per-phase and per-layer peaks, a timeline) and counts each op's FLOPs by phase."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakIdKeyDictionary

from graphviz_core.capture.flop_formulas import op_info
from graphviz_core.capture.meta_kernels import GROUPED_MM, cuda_attention, cuda_temporary_bytes, grouped_mm_on_meta
from graphviz_core.parallel.settings import FSDP_STRATEGIES, ParallelConfig
from graphviz_core.parallel.world import check_stopped, running_of

PHASES = ("forward", "backward", "optimizer")


MIN_PHASE_POINTS = 20  # a phase drawn with fewer reads as a tick
TIMELINE_POINTS = 300  # enough for a chart; a 70B step issues ~10^5 ops


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


class PhasePeaks(torch.utils._python_dispatch.TorchDispatchMode):
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
        if func.namespace == "aten" and not _propagating.active:
            # A cancelled request, or one past the server's run time limit, stops at this rank's next tensor op: not
            # at prim.device, which autograd's C++ reads where an exception ends the process, nor inside DTensor's
            # sharding propagation, which would report it as its own failure.
            check_stopped()
        if func is GROUPED_MM and is_fake(args[0]):  # a mixture of experts' GEMMs: the fake kernel refuses float32,
            # which the CPU kernel runs
            out = grouped_mm_on_meta(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        if _propagating.active:  # DTensor working out an op's global shape, not this rank's work
            return out
        # A kernel's own workspace (the GPU's softmax kernels: meta_kernels.cuda_temporary_bytes) is live while it
        # runs, its inputs and output beside it: the moment after the op, plus that, is the op's high-water mark.
        held = cuda_temporary_bytes(func, args)
        formula, _ = op_info(func)
        if formula is not None:
            flops = int(formula(*args, out_val=out, **(kwargs or {})))
            self.flops += flops
            self.flops_by_phase[self.phase] = self.flops_by_phase.get(self.phase, 0) + flops
        if held:
            self.observe(held)
        self.observe()
        return out

    def observe(self, held: int = 0) -> None:
        """Sample the running totals; `held` bytes of an op's workspace counted as temporaries beside them."""
        snapshot = self.tracker._curr_mem_snap  # the tracker's running per-device totals (read only)
        if not snapshot:
            return
        parts = next(iter(snapshot.values()))
        if held:
            parts = {**parts, "Temp": parts.get("Temp", 0) + held, "Total": parts["Total"] + held}
        total = parts["Total"] - buffers_of(parts)  # module buffers are reported beside the peaks, not in them
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
            return f"layer {running_of(inside, self.phase, lambda i: i)}"  # two layers can be held at once
        return "post" if self._in_layers else "pre"


def memory_tracker(model: nn.Module, optimizer, parallel: ParallelConfig, holder: nn.Module | None = None):
    """torch's memory tracker over `model` and its optimizer: FSDPMemTracker under FSDP / HSDP / DDP, MemTracker
    otherwise. A pipeline rank passes its first stage as `model` and all its stages as `holder`: FSDPMemTracker takes
    one FSDP root, and a rank of an interleaved schedule holds several; it instruments the FSDP modules it finds under
    its root, so the rank's stages together (a plain ModuleList) serve."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if parallel.strategy in (*FSDP_STRATEGIES, "ddp"):
        tracker = FSDPMemTracker(model, optimizer)
        if holder is not None:
            tracker._root_mod = holder
    else:
        tracker = MemTracker()
        tracker.track_external(model if holder is None else holder, optimizer)
    # After every op the tracker walks every module it has seen to update per-module peaks (deep-copying
    # snapshots): quadratic in model size, 4 minutes of a 70B one-device run. We read its running totals
    # ourselves (PhasePeaks), so that bookkeeping is switched off; the storage accounting is untouched.
    tracker._update_peak_stats = lambda peak_state: None
    # MemTracker hooks the gradient of every parameter a module holds when the module first runs, and a frozen one
    # (LoRA's base weights, --freeze) refuses a hook; it gets no gradient to count either, so it is skipped.
    tracker._param_to_grad_hook_handles = _FrozenSkipped()
    return tracker


def gpu_attention(parallel: ParallelConfig):
    """Where `auto` picks CUDA, attention and the softmax kernels as a CUDA GPU runs them for the step
    (meta_kernels.cuda_attention), as a meta dry run mirrors them there; elsewhere this machine's kernels, so that
    the one-device figures equal a capture's here. Not under context parallel, whose ring takes the fused kernels'
    calls (torch's context_parallel)."""
    import contextlib

    return cuda_attention() if parallel.cp == 1 and mirrors_cuda() else contextlib.nullcontext()


def mirrors_cuda() -> bool:
    """Whether the simulation takes its kernels as CUDA's: where `auto` picks CUDA (GRAPHVIZ_CORE_DEVICE included)."""
    from graphviz_core.capture.device import resolve_device

    return resolve_device("auto") == "cuda"


def track_batch(tracker, *batch: torch.Tensor) -> None:
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


def parts_of(snapshot: dict) -> dict[str, int]:
    parts = dict.fromkeys(PARTS, 0)
    for kind, nbytes in snapshot.items():
        name = getattr(kind, "value", kind)
        if name not in ("Total", BUFFER_KIND):
            parts[_KIND_OF.get(name, "temporaries")] += nbytes
    return parts


def buffers_of(snapshot: dict) -> int:
    """The module buffers' bytes in a tracker snapshot."""
    return sum(nbytes for kind, nbytes in snapshot.items() if getattr(kind, "value", kind) == BUFFER_KIND)


def phase_memories(peaks: PhasePeaks) -> tuple[PhaseMemory, ...]:
    """Each phase's peak, part by part, as the step's observer kept it."""
    return tuple(
        PhaseMemory(phase, peaks.peaks[phase][0], parts_of(peaks.peaks[phase][1]), buffers_of(peaks.peaks[phase][1]))
        for phase in PHASES
        if phase in peaks.peaks
    )


def downsample(samples: list[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """At most about TIMELINE_POINTS samples, each window's maximum kept (peaks survive the thinning), and every phase
    kept apart: a window never spans two phases, and each phase keeps at least MIN_PHASE_POINTS of its own (or all it
    has). Windows across the whole step once left Adafactor's short optimizer phase one point of 300, drawn as no
    optimizer segment at all beside a 277 KiB optimizer peak."""
    if len(samples) <= TIMELINE_POINTS:
        return tuple(samples)
    runs = [list(run) for _, run in itertools.groupby(samples, key=lambda s: s[0])]  # each phase's samples in order
    out = []
    for run in runs:
        points = max(min(len(run), MIN_PHASE_POINTS), round(TIMELINE_POINTS * len(run) / len(samples)))
        step = len(run) / points
        for i in range(points):
            window = run[int(i * step) : int((i + 1) * step)] or run[-1:]
            out.append(max(window, key=lambda s: s[1]))
    return tuple(out)
