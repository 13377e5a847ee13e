"""`graphviz_core.record(path, steps=...)`: record a user's own training loop, step after step (docs/recording.md).

    with graphviz_core.record("runs/exp1", steps=100) as rec:
        for batch in loader:
            loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()

What it hooks, all removed when the block ends:

- torch.optim's global optimizer step hooks: before a step, each parameter's gradient and weight norms (one
  `torch._foreach_norm` per device and dtype) and a copy of the weights; after it, the update norms; then the step
  is written. `rec.step()` closes a step where a loop has no torch.optim optimizer.
- `torch.autograd.backward` (which `Tensor.backward` calls) and `torch.autograd.grad`: each backward's graph is
  walked from its roots and every node gets a pre and a post hook (capture.record_hooks); a graph seen for the first
  time is stored once with its saved bytes and FLOPs.
- global module forward hooks (capture.record_hooks.ModuleCalls): which module created each node, parameter names.
- `torch.amp.GradScaler.scale` and `.step`: gradient figures divided by the scale the backward ran with; a step the
  scaler skipped (inf/NaN found) is written with `skipped` true.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
import warnings
from collections.abc import Iterator

import torch

from graphviz_core.capture.record_hooks import BackwardProbe, ModuleCalls
from graphviz_core.capture.record_writer import RecordingWriter

COMPILE_HOOKS_WARNING = "Using `torch.compile(module)` when there are global hooks on modules"
_ACTIVE = threading.Lock()  # one recording per process: the hooks it installs are process-wide



def _traced(roots: list) -> bool:
    """Whether a backward is torch.compile tracing one (AOTAutograd's joint graph runs torch.autograd.grad over fake or
    functional tensors while compiling) rather than the user's own: such a call is passed through untouched."""
    if torch.compiler.is_compiling():
        return True
    return any(isinstance(r, torch.Tensor) and (type(r) is not torch.Tensor and not isinstance(r, torch.nn.Parameter)
                                                or torch._is_functional_tensor(r)) for r in roots)

class UnclosedSteps(UserWarning):
    """Backward passes ran inside record() after its last step closed, and no step closed them: they are not in the
    recording (a loop without a torch.optim optimizer that never called rec.step())."""


class Recorder:
    """The object `record()` yields. `step()` closes a step by hand; `steps_written` counts the steps written."""

    def __init__(self, path, steps: int | None, model: torch.nn.Module | None, nodes: bool,
                 nodes_every: int = 1, eager: bool = False) -> None:
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be a whole number of optimizer steps, 1 or more (or None for all); got "
                             f"{steps!r}.")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be the torch.nn.Module being trained; got a {type(model).__name__}.")
        self.writer = RecordingWriter(path, steps, eager)
        self.limit = steps
        self.nodes = nodes
        self.nodes_every = nodes_every  # per-node figures on every this-many-th step (0, N, 2N, ...)
        self.modules = ModuleCalls(model, track_calls=nodes)
        self.depth = 0  # > 0 while a recorded backward runs (a reentrant checkpoint's inner backward is part of it)
        self.active = True
        self.steps_written = 0
        self.started = time.perf_counter()
        self._reset_step()
        self.before: dict[int, torch.Tensor] = {}  # id(param) -> its weights before the optimizer's step
        self.pre_figures: dict | None = None
        self.peak_before_step: int | None = None  # CUDA: the loop's peak before the optimizer's step (_before_step)
        self.optimizer_stepped = False
        self.scaler_scales: dict[int, tuple] = {}  # id(scaled loss) -> (weakref, the scale tensor then)
        self.handles: list = []
        self.originals: dict = {}
        self.debug = None  # capture.nonfinite.DebugWatch (issue 36), set by record() when nodes are recorded
        self.silenced = None  # the warnings filter install() adds (torch's global-hooks warning), removed by remove()

    # ---- installing and removing ------------------------------------------------------------------------------
    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.handles = [register_optimizer_step_pre_hook(self._before_step),
                        register_optimizer_step_post_hook(self._after_step)]
        self.modules.install()
        scaler = torch.amp.grad_scaler.GradScaler
        self.originals = {(torch.autograd, "backward"): torch.autograd.backward,
                          (torch.autograd, "grad"): torch.autograd.grad,
                          (scaler, "scale"): scaler.scale, (scaler, "step"): scaler.step}
        torch.autograd.backward = self._wrap_backward(self.originals[(torch.autograd, "backward")])
        torch.autograd.grad = self._wrap_backward(self.originals[(torch.autograd, "grad")])
        scaler.scale = self._wrap_scale(self.originals[(scaler, "scale")])
        scaler.step = self._wrap_scaler_step(self.originals[(scaler, "step")])
        if self.debug is not None:
            self.debug.install()
        # torch warns that torch.compile(module) fires global module hooks once more, for its wrapper: the recorder's
        # hooks are global, and they expect that call (a module outside the model's names is not recorded); the
        # warning, raised for the user's own compile call inside the block, is silenced while it runs, no other
        warnings.filterwarnings("ignore", message=re.escape(COMPILE_HOOKS_WARNING), category=UserWarning)
        self.silenced = warnings.filters[0]

    def remove(self) -> None:
        if self.silenced in warnings.filters:
            warnings.filters.remove(self.silenced)
            getattr(warnings, "_filters_mutated", lambda: None)()  # the module's caches see the filter gone
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.modules.remove()
        for (owner, name), original in self.originals.items():
            setattr(owner, name, original)
        self.originals = {}
        self.before.clear()
        if self.debug is not None:
            self.debug.remove()

    # ---- steps --------------------------------------------------------------------------------------------------
    def unclosed(self) -> str:
        """The sentence for backward passes that no step closed (UnclosedSteps)."""
        count = len(self.backwards)
        what = (f"{count:,} backward pass{'es' if count != 1 else ''} after the last recorded step "
                if self.steps_written else f"{count:,} backward pass{'es' if count != 1 else ''} ")
        return (f"{what}{'were' if count != 1 else 'was'} not recorded: a step is closed by a torch.optim optimizer's "
                f"step() (or by rec.step() in a loop without one; docs/recording.md), and none followed "
                f"{'them' if count != 1 else 'it'}.")

    def nodes_now(self) -> bool:
        """Whether the step being recorded gets per-node figures (nodes=True, and a multiple of nodes_every)."""
        return self.nodes and self.steps_written % self.nodes_every == 0

    def _reset_step(self) -> None:
        self.backwards: list[dict] = []  # per backward: graph id, node columns, loss, gradient into the parameters
        self.scale: float | None = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

    def step(self) -> None:
        """Close a step by hand (a loop without a torch.optim optimizer): the backwards since the last step, and the
        gradient and weight norms of the model's parameters (no update figures: nothing stepped). After an optimizer
        step, which closes the step itself, this does nothing."""
        if not self.active or not self.backwards:
            return
        params = [p for p in self._known_parameters() if p.grad is not None]
        figures = self._norms(params)
        self._write(params, figures, None, skipped=False, lrs=[])

    def _known_parameters(self) -> list:
        seen, out = set(), []
        for ref in self.modules.roots:
            root = ref()
            for p in (root.parameters() if root is not None else ()):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    @staticmethod
    def _optimizer_params(optimizer) -> list[tuple[torch.Tensor, float | None]]:
        out = []
        for group in optimizer.param_groups:
            lr = group.get("lr")
            lr = float(lr) if lr is not None else None
            out += [(p, lr) for p in group["params"] if p.grad is not None]
        return out

    @staticmethod
    def _norms(tensors: list, grads: bool = True) -> list[float]:
        """L2 norms of the tensors' gradients (or of the tensors), one _foreach_norm per device and dtype, read in one
        transfer; float32 accumulation (a float16 norm overflows at 65,504)."""
        if not tensors:
            return []
        items = [p.grad if grads else p.detach() for p in tensors]
        groups: dict = {}
        for i, t in enumerate(items):
            # a DTensor (FSDP2, tensor parallel) by its mesh and placements too: its norm is the whole tensor's
            layout = (t.device_mesh, tuple(t.placements)) if hasattr(t, "device_mesh") else None
            groups.setdefault((t.device, t.dtype, layout), []).append(i)
        out = [0.0] * len(items)
        with torch.no_grad():
            for (_, _, layout), indices in groups.items():
                group = [items[i] for i in indices]
                if group[0].is_sparse:
                    norms = [torch.linalg.vector_norm(t.coalesce().values(), dtype=torch.float32) for t in group]
                else:
                    norms = torch._foreach_norm(group, 2, dtype=torch.float32)
                stacked = torch.stack(list(norms))
                if layout is not None:
                    # the shards' norms combined across the ranks holding them (one collective for the group): the
                    # whole parameter's norm on every rank, as torch.nn.utils.clip_grad_norm_ takes it
                    stacked = stacked.full_tensor()
                for i, value in zip(indices, stacked.tolist(), strict=True):
                    out[i] = value
        return out

    def _loop_peak(self, device: torch.device) -> int:
        """The allocator's peak on `device` since its counter last started, less what the recorder itself holds there:
        its copy of the parameters from before the optimizer's step (a model over several GPUs: only the copies on
        this device), never below 0."""
        own = sum(b.numel() * b.element_size() for b in self.before.values() if b.device == device)
        return max(0, torch.cuda.max_memory_allocated(device) - own)

    def _before_step(self, optimizer, args, kwargs) -> None:
        if not self.active:
            return
        pairs = self._optimizer_params(optimizer)
        params = [p for p, _ in pairs]
        self.pre_figures = {"params": params, "lrs": [lr for _, lr in pairs], "grad": self._norms(params),
                            "weight": self._norms(params, grads=False)}
        if self.debug is not None:
            self.debug.before_update(params, self.pre_figures["grad"])
        if params and params[0].is_cuda:
            # the loop's peak so far (forward and backward), the recorder's own copy left out; the peak counter then
            # starts again for the optimizer's step, read with the copy left out again (_peak)
            self.peak_before_step = self._loop_peak(params[0].device)
        with torch.no_grad():
            buffers = []
            locals_ = [_local(p) for p in params]
            for p, local in zip(params, locals_, strict=True):  # one buffer per parameter, kept from step to step
                buffer = self.before.get(id(p))
                if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype or \
                        buffer.device != local.device:
                    buffer = self.before[id(p)] = torch.empty_like(local, memory_format=torch.preserve_format)
                buffers.append(buffer)
            if buffers:
                torch._foreach_copy_(buffers, locals_)
        if params and params[0].is_cuda:
            torch.cuda.reset_peak_memory_stats(params[0].device)

    def _after_step(self, optimizer, args, kwargs) -> None:
        if not self.active or self.pre_figures is None:
            return
        self.optimizer_stepped = True
        figures, self.pre_figures = self.pre_figures, None
        params = figures["params"]
        with torch.no_grad():  # before - after, in the buffers themselves: its norm is the update's
            deltas = [self.before[id(p)] for p in params]
            if deltas:
                torch._foreach_sub_(deltas, [_local(p) for p in params])
        updates = self._norms([_like(p, d) for p, d in zip(params, deltas, strict=True)], grads=False)
        self._write(params, (figures["grad"], figures["weight"]), updates, skipped=False, lrs=figures["lrs"],
                    optimizer=optimizer)

    def _skipped(self, optimizer) -> None:
        """The GradScaler found inf or NaN and did not call the optimizer's step: a step all the same, marked so."""
        pairs = self._optimizer_params(optimizer)
        params = [p for p, _ in pairs]
        self._write(params, (self._norms(params), self._norms(params, grads=False)), [0.0] * len(params),
                    skipped=True, lrs=[lr for _, lr in pairs], optimizer=optimizer)

    def _write(self, params, figures, updates, *, skipped: bool, lrs: list, optimizer=None) -> None:
        if isinstance(figures, list):  # step(): gradient norms only, weights read here
            figures = (figures, self._norms(params, grads=False))
        grads, weights = figures
        if self.writer.rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_available() and \
                torch.distributed.is_initialized() else 0
            self.writer.open_rank(rank)
        names = self.modules.param_names
        index = self.steps_written
        ratios = [None if updates is None or not w else updates[i] / w for i, w in enumerate(weights)]
        parameters = {
            "step": [index] * len(params),
            "name": [names.get(id(p), f"parameter.{i}") for i, p in enumerate(params)],
            "grad_norm": grads, "weight_norm": weights,
            "update_norm": updates if updates is not None else [None] * len(params),
            "update_ratio": ratios,
            "lr": lrs if lrs else [None] * len(params),
        }
        columns = {"grad_norm": [], "max_abs": [], "nonfinite": [], "time_s": [], "min": [], "max": []}
        walked = [b for b in self.backwards if b["graph"] is not None]
        for backward in walked:
            for key in columns:
                columns[key] += backward["columns"][key]
        losses = [b["loss"] for b in self.backwards]
        finite = [v for v in losses if v is not None]
        peak, source = self._peak(params, optimizer)
        total = math.sqrt(sum(g * g for g in grads)) if grads else None
        now = time.perf_counter()
        step = {
            "step": index, "loss": sum(finite) if finite and len(finite) == len(losses) else None,
            "skipped": skipped, "scale": self.scale, "peak_bytes": peak, "peak_source": source,
            "lr": lrs[0] if lrs else None, "lrs": sorted(set(lrs), key=lrs.index) if lrs else [],
            "time_s": now - self.started,
            "backward_graphs": [b["graph"] for b in walked],
            "backward_nodes": [len(b["columns"]["grad_norm"]) for b in walked],
            "micro_losses": [math.nan if v is None else v for v in losses],
            "micro_grad_norms": [math.nan if b["into"] is None else b["into"] for b in self.backwards],
            "grad_norm": total,
        }
        self.writer.write_step(step, parameters, columns)
        if self.debug is not None:
            self.debug.end_step(index, params, grads, sampled=bool(walked))
        self.started = now
        self.steps_written += 1
        self._reset_step()
        if self.limit is not None and self.steps_written >= self.limit:
            self.active = False  # the loop runs on unrecorded; the hooks return at once until the block ends
            self.modules.remove()
            if self.debug is not None:
                self.debug.stop()

    def _peak(self, params, optimizer) -> tuple[int | None, str]:
        if params and params[0].is_cuda:
            # the loop's own peak: the allocator's, less the recorder's copy of the parameters (held all through the
            # optimizer's step, where the counter was restarted), the larger of before and during the step
            during = self._loop_peak(params[0].device)
            before, self.peak_before_step = self.peak_before_step, None
            return max(during, before or 0), "cuda allocator"
        parameter_bytes = sum(p.numel() * p.element_size() for p in params)
        state = 0
        if optimizer is not None:
            for entry in optimizer.state.values():
                state += sum(t.numel() * t.element_size() for t in entry.values() if isinstance(t, torch.Tensor))
        saved = max((b["saved_bytes"] for b in self.backwards), default=0)
        return 2 * parameter_bytes + state + saved, "estimate"

    # ---- the wrapped torch functions ------------------------------------------------------------------------------
    def _wrap_backward(self, original):
        recorder = self

        def recorded(tensors, *args, **kwargs):
            if not recorder.active or recorder.depth or threading.current_thread() is not recorder.thread:
                return original(tensors, *args, **kwargs)
            roots = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
            if _traced(roots):  # torch.compile's own tracing of a backward (fake tensors): not the user's backward
                return original(tensors, *args, **kwargs)
            recorder.depth += 1
            try:
                return recorder._backward(original, roots, tensors, args, kwargs)
            finally:
                recorder.depth -= 1

        recorded.__wrapped__ = original
        recorded.__doc__ = original.__doc__
        return recorded

    def _backward(self, original, roots, tensors, args, kwargs):
        scale_tensor = None
        for root in roots:
            found = self.scaler_scales.get(id(root))
            if found is not None and found[0]() is root:
                scale_tensor = found[1]
        loss = roots[0].detach() if len(roots) == 1 and isinstance(roots[0], torch.Tensor) and \
            roots[0].numel() == 1 else None
        if not self.nodes_now():
            if self.nodes:
                self.modules.clear()  # this step's module calls are not needed: no graph is walked
            result = original(tensors, *args, **kwargs)
            scale = float(scale_tensor) if scale_tensor is not None else 1.0
            self.backwards.append({"graph": None, "loss": None if loss is None else float(loss) / scale,
                                   "into": None, "saved_bytes": 0})
            return result
        cuda = any(isinstance(r, torch.Tensor) and r.is_cuda for r in roots)
        probe = BackwardProbe(roots, self.modules, self.writer.graphs, cuda)
        if self.debug is not None:
            self.debug.backward(probe, roots)
        try:
            with probe.flop_mode() if probe.new else contextlib.nullcontext():
                result = original(tensors, *args, **kwargs)
        except BaseException:
            if self.debug is not None:  # this backward is not recorded: the watch forgets it too
                self.debug.backward_failed()
            raise
        finally:
            probe.remove()
            self.modules.clear()
        if cuda:
            torch.cuda.synchronize()
        scale = float(scale_tensor) if scale_tensor is not None else 1.0
        self.scale = scale if scale_tensor is not None else self.scale
        columns, into = probe.figures(scale)
        if probe.new:
            self.writer.write_graph(probe.id, probe.structure)
            self.saved_bytes_of[probe.id] = sum(n["saved_bytes"] for n in probe.structure["nodes"])
        value = None if loss is None else float(loss) / scale
        self.backwards.append({"graph": probe.id, "columns": columns, "loss": value, "into": into,
                               "saved_bytes": self.saved_bytes_of.get(probe.id, 0)})
        probe.release()
        return result

    def _wrap_scale(self, original):
        recorder = self

        def scale(scaler, outputs):
            scaled = original(scaler, outputs)
            if recorder.active and isinstance(scaled, torch.Tensor) and getattr(scaler, "_scale", None) is not None:
                import weakref

                recorder.scaler_scales = {id(scaled): (weakref.ref(scaled), scaler._scale.detach().clone())}
            return scaled

        return scale

    def _wrap_scaler_step(self, original):
        recorder = self

        def step(scaler, optimizer, *args, **kwargs):
            recorder.optimizer_stepped = False
            result = original(scaler, optimizer, *args, **kwargs)
            if recorder.active and not recorder.optimizer_stepped and getattr(scaler, "_enabled", True):
                recorder._skipped(optimizer)
            return result

        return step


def _local(p: torch.Tensor) -> torch.Tensor:
    """The values of `p` this process holds: a DTensor's (FSDP2, tensor parallel) local shard, else `p` itself."""
    return p.to_local() if hasattr(p, "to_local") else p.detach()


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this process's part) laid out as `p` is: a DTensor again for a DTensor parameter, so that its norm is
    the whole tensor's."""
    if not hasattr(p, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


@contextlib.contextmanager
def record(path, *, steps: int | None = None, model: torch.nn.Module | None = None, check_forward: bool = False,
           nodes: bool = True, nodes_every: int = 1, eager: bool = False) -> Iterator[Recorder]:
    """Record the training loop run inside the block into the folder `path` (docs/recording.md).

    `steps`: stop recording after that many optimizer steps (the loop runs on). `model`: the module being trained
    (parameter and module names come from it; without it, from the outermost module the forward calls).
    `nodes=False` records the per-step and per-parameter figures only (no per-node hooks: the cheapest mode).
    `nodes_every=N`: the per-node figures on steps 0, N, 2N, ... only, the per-step and per-parameter figures on
    every step (on a GPU, where the per-node work costs most: docs/recording.md).
    `check_forward=True`: every op of the forward checked for NaN and inf, and each node's forward source line
    kept (capture.nonfinite; docs/debugging.md).
    `eager=True`: torch.compile'd code runs eagerly inside the block (`torch.compiler.set_stance("force_eager")`):
    the eager replay of a compiled loop, each op a node of its own where a compiled region is one node.
    """
    if isinstance(nodes_every, bool) or not isinstance(nodes_every, int) or nodes_every < 1:
        raise ValueError(f"nodes_every is how often a step gets per-node figures: a whole number from 1 (every "
                         f"step), not {nodes_every!r}.")
    if nodes_every != 1 and not nodes:
        raise ValueError("nodes_every chooses the steps with per-node figures; a recording with nodes=False has none "
                         "(leave one of them out).")
    if check_forward and not nodes:
        raise ValueError("check_forward needs the per-node figures; record with nodes=True (the default).")
    if not _ACTIVE.acquire(blocking=False):
        raise ValueError("a recording is already running in this process; record one loop at a time.")
    recorder = None
    try:
        if not isinstance(eager, bool):
            raise ValueError(f"eager is True (run torch.compile'd code eagerly while recording) or False; got "
                             f"{eager!r}.")
        if eager and not hasattr(torch.compiler, "set_stance"):
            raise ValueError(f"eager=True runs compiled code eagerly through torch.compiler.set_stance, new in torch "
                             f"2.6; this is torch {torch.__version__}.")
        recorder = Recorder(path, steps, model, nodes, nodes_every, eager)
        recorder.thread = threading.current_thread()
        recorder.saved_bytes_of = {}
        if nodes:
            from graphviz_core.capture.nonfinite import DebugWatch

            recorder.debug = DebugWatch(recorder, check_forward)
        recorder.install()
        clean = False
        try:
            with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
                yield recorder
            clean = True
        finally:
            recorder.remove()
            recorder.writer.close(complete=clean)
        if recorder.active and recorder.backwards:
            warnings.warn(UnclosedSteps(recorder.unclosed()), stacklevel=3)
    finally:
        _ACTIVE.release()
