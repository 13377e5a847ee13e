"""The memory timeline: bytes live at every step of one forward + backward, by kind, from tracking storages.

`StorageObserver` is one instrument of a capture (graphviz_core.capture.instrument), as PyTorch's own
`torch.distributed._tools.mem_tracker.MemTracker` is a small observer of one run: the capture's dispatch mode shows it
every storage an aten op creates, and a weak reference with a callback sees it freed. Steps are the forward's aten ops (named by op and the
innermost module running) and then the backward's autograd nodes in the order the engine ran them. On
CUDA each step also samples `torch.cuda.memory_allocated()`, the allocator's own count.

Kinds: a storage is a *parameter* (existed before the forward, owned by the model), a *gradient* (ends up
as a parameter's `.grad`), a *saved activation* (alive at the end of the forward because autograd saved it
for backward), *held for recompute* (an input a checkpointed region keeps so it can re-run its forward),
*recomputed* (created in backward by checkpointing re-running a forward) or a *temporary* (everything else:
the batch, outputs that die young, gradients flowing between nodes).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import networkx as nx
import torch

from graphviz_core.capture.instrument import Instrument, Run

KINDS = ("parameters", "gradients", "saved activations", "held for recompute", "recomputed", "temporaries")


@dataclass(frozen=True)
class TimelineStep:
    """Bytes live at the high-water moment of one step, by kind (the same order as KINDS)."""

    index: int
    phase: str  # "start", "forward" or "backward"
    label: str  # aten op (forward) or autograd node id (backward)
    module: str  # innermost module running (forward) or the node's module (backward)
    bytes_by_kind: tuple[int, ...]
    allocator_bytes: int | None  # torch.cuda.memory_allocated() at the step's end; None off CUDA

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_kind)


@dataclass(frozen=True)
class MemoryTimeline:
    """Every step of one run, and the peak over all of them."""

    steps: tuple[TimelineStep, ...]
    peak_bytes: int  # highest total of tracked storages at any moment
    peak_step: int  # index into steps
    activation_peak_bytes: int  # highest total of everything but parameters and gradients
    forward_end_step: int  # index of the last forward step

    @property
    def peak(self) -> TimelineStep:
        return self.steps[self.peak_step]

    def to_dict(self) -> dict:
        """The JSON form (`memory.timeline` in the CLI's output): kinds once, then one row per step."""
        return {
            "kinds": list(KINDS),
            "peak_bytes": self.peak_bytes,
            "peak_step": self.peak_step,
            "activation_peak_bytes": self.activation_peak_bytes,
            "forward_end_step": self.forward_end_step,
            "steps": [
                {
                    "phase": s.phase,
                    "label": s.label,
                    "module": s.module,
                    "bytes": list(s.bytes_by_kind),
                    "total_bytes": s.total_bytes,
                    "allocator_bytes": s.allocator_bytes,
                }
                for s in self.steps
            ],
        }


class _Record:
    """One storage: its size, its kind (decided when the forward or backward ends) and its weak reference."""

    __slots__ = ("key", "kind", "nbytes", "ref")

    def __init__(self, nbytes: int, kind: int) -> None:
        self.nbytes = nbytes
        self.kind = kind
        self.key = 0  # the storage's _cdata while it lives
        self.ref: weakref.ref | None = None


_PARAM, _GRAD, _SAVED, _HELD, _RECOMPUTED, _TEMP = range(len(KINDS))


class StorageObserver(Instrument):
    """Tracks every storage created and freed during one forward + backward; `result` summarises it.

    Parameters and the batch are tracked when the run starts; `on_op` sees what every aten op of the model returned
    (not the capture's own bookkeeping), `node_pre` starts a backward step; the saved tensors' storages become
    *saved activations* when the forward ends, and those that became a parameter's `.grad` *gradients* when the
    backward ends."""

    name = "timeline"
    needs = ("saved",)  # which storages autograd saved, and which inputs checkpoints hold

    def start(self, run: Run) -> None:
        super().start(run)
        self.cuda = run.device == "cuda"
        self.live: dict[int, _Record] = {}  # storage _cdata -> record; unique among live storages
        self.refs: dict[int, _Record] = {}  # id(weak reference to a tracked storage) -> its record, which keeps the ref
        self.events: list[tuple[int, _Record, int]] = []  # (step, record, +1 alloc / -1 free)
        self.steps: list[list] = [["start", "", "", None]]  # phase, label, module, allocator bytes
        self.forward_end = 0
        self.result: MemoryTimeline | None = None
        # Module buffers are no part of a peak (reported on their own as buffer_bytes): an op that updates one in
        # place (BatchNorm's num_batches_tracked.add_(1)) returns its storage, which is then not a new temporary.
        self.buffers = {b.untyped_storage()._cdata for b in run.model.buffers()}
        self.track_existing(run.model.parameters(), parameters=True)
        self.track_existing(run.held, parameters=False)

    # ---- storages -------------------------------------------------------------------------------------

    def _track(self, t: torch.Tensor, kind: int) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live or key in self.buffers:
            return
        record = _Record(storage.nbytes(), kind)
        record.key = key
        record.ref = weakref.ref(storage, self._on_free)
        self.refs[id(record.ref)] = record
        self.live[key] = record
        self.events.append((len(self.steps) - 1, record, 1))

    def _on_free(self, ref: weakref.ref) -> None:
        """A tracked storage was freed (one bound method for all: a closure per storage cost more)."""
        record = self.refs.pop(id(ref), None)
        if record is None:
            return
        if self.live.get(record.key) is record:
            del self.live[record.key]
        self.events.append((len(self.steps) - 1, record, -1))

    def track_existing(self, tensors: Iterable[torch.Tensor], parameters: bool) -> None:
        for t in tensors:
            self._track(t, _PARAM if parameters else _TEMP)

    def live_bytes(self) -> int:
        """The bytes of every tracked storage alive now."""
        return sum(record.nbytes for record in self.live.values())

    def on_op(self, func, args, kwargs, out) -> None:
        """Record what aten op `func` just returned."""
        modules = self.run.modules
        if self.run.phase == "forward":
            self.steps.append(["forward", func.__name__, modules.stack[-1] if modules.stack else "", None])
        kind = _RECOMPUTED if modules.recompute_depth else _TEMP
        if isinstance(out, torch.Tensor):
            self._track(out, kind)
        else:
            for t in tensors_in(out):
                self._track(t, kind)
        if self.cuda:
            self.steps[-1][3] = torch.cuda.memory_allocated()

    # ---- phases ---------------------------------------------------------------------------------------

    def after_forward(self, run: Run) -> None:
        """Storages alive now that autograd saved are saved activations; inputs kept by checkpoints are held. Then
        the backward starts: nodes are steps; a module called now is checkpointing's recompute."""
        saved = run.instrument("saved")
        saved_keys = saved.saved_keys
        self.forward_end = len(self.steps) - 1
        held = set(saved.checkpoint_held)
        for key, record in self.live.items():
            if record.kind != _TEMP:
                continue
            if key in saved_keys:
                record.kind = _SAVED
            elif key in held:
                record.kind = _HELD
        self.steps.append(["backward", "backward starts", "", torch.cuda.memory_allocated() if self.cuda else None])

    def node_pre(self, node_id: str) -> None:
        self.steps.append(["backward", node_id, "", torch.cuda.memory_allocated() if self.cuda else None])

    def after_backward(self, run: Run) -> None:
        """Storages that became a parameter's .grad are gradients from the moment they were made."""
        for p in run.model.parameters():
            if p.grad is not None:
                record = self.live.get(p.grad.untyped_storage()._cdata)
                if record is not None and record.kind in (_TEMP, _RECOMPUTED):
                    record.kind = _GRAD

    def release(self) -> None:
        self.live.clear()
        self.refs.clear()  # weak references dropped: storages freed later call back nothing

    # ---- result ---------------------------------------------------------------------------------------

    def finish(self, run: Run, graph: nx.DiGraph) -> None:
        self.result = self.timeline(lambda n: graph.nodes[n]["module"] if n in graph else "")

    def timeline(self, module_of: Callable[[str], str]) -> MemoryTimeline:
        """Per step, the breakdown at its highest total; `module_of(node_id)` names backward steps' modules."""
        live = [0] * len(KINDS)
        total = 0
        best: list[tuple[int, ...] | None] = [None] * len(self.steps)
        best_total = [-1] * len(self.steps)
        peak, peak_step, activation_peak = 0, 0, 0
        events = self.events
        i = 0
        for step in range(len(self.steps)):
            while i < len(events) and events[i][0] == step:
                _, record, sign = events[i]
                live[record.kind] += sign * record.nbytes
                total += sign * record.nbytes
                i += 1
                if total > best_total[step]:
                    best_total[step], best[step] = total, tuple(live)
                if total > peak:
                    peak, peak_step = total, step
                activation_peak = max(activation_peak, total - live[_PARAM] - live[_GRAD])
            if best[step] is None:  # nothing happened in this step: it holds what the last one ended with
                best_total[step], best[step] = total, tuple(live)
        steps = tuple(
            TimelineStep(
                index, phase, label, module_of(label) if phase == "backward" else module, best[index], allocator
            )
            for index, (phase, label, module, allocator) in enumerate(self.steps)
        )
        return MemoryTimeline(steps, peak, peak_step, activation_peak, self.forward_end)


def tensors_in(obj: object) -> Iterable[torch.Tensor]:
    """Every tensor in `obj`, through lists, tuples and dict values."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


def sampled_steps(timeline: MemoryTimeline, max_points: int = 1500) -> list[TimelineStep]:
    """At most about `max_points` steps for a chart: per run of consecutive steps, the one with the highest total
    (so no peak is lost), always including the overall peak and the end of the forward."""
    steps = timeline.steps
    if len(steps) <= max_points:
        return list(steps)
    size = -(-len(steps) // max_points)
    keep = {timeline.peak_step, timeline.forward_end_step, 0, len(steps) - 1}
    for start in range(0, len(steps), size):
        keep.add(max(range(start, min(start + size, len(steps))), key=lambda i: steps[i].total_bytes))
    return [steps[i] for i in sorted(keep)]
