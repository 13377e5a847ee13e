"""The recorder's debugging instruments (issue 36; docs/debugging.md), installed beside the recorder's own hooks:

- which module's forward ran this step, with gradients on or off, and whether its output reached the loss (the
  reasons a trainable parameter got no gradient: never ran, ran under no_grad, its output detached, or it never
  reached the loss);
- dead units: for each ReLU-family module (nn.ReLU, nn.ReLU6), which of its units (the last dimension) were zero
  for every position of the whole batch;
- with `check_forward=True`, a torch function mode over the forward: each op's output checked for NaN and ±inf
  (the first op whose output holds a NaN no input held, or an inf no input held, is the producer) and each autograd
  node's forward source line (`file:line`, the first frame outside torch and this package).

- the shape and dtype of the gradient each edge of the walked graph carries (read from autograd's own metadata of
  each node's inputs before the backward runs: nothing is computed), once per distinct graph and set of sizes.

Everything is written, as the run goes, to `rank-<r>/debug.jsonl` in the recording (one JSON object per line: a
`parameters` line first, then one `step` line per step, one `sources` line per distinct graph and one `link_shapes`
line per distinct graph and sizes);
graphviz_core.analysis.gradient_flow reads it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import weakref

import torch
from torch._C._autograd import _get_sequence_nr
from torch.overrides import TorchFunctionMode

DEBUG_FILE = "debug.jsonl"
RELU_FAMILY = (torch.nn.ReLU, torch.nn.ReLU6)
# the functional forms, seen by the forward check alone (its torch-function mode sees every call); inside an nn.ReLU
# module the module's own count stands
FUNCTIONAL_RELUS = {torch.nn.functional.relu, torch.relu, torch.nn.functional.relu6, torch.Tensor.relu}
MAX_DETACHED = 256  # detach calls kept between two backwards
_ACCESSORS = ("__get__", "__set__", "__delete__")  # a tensor's attribute read (p.grad), not an op of the forward
# ops whose output is memory nobody wrote yet (whatever bytes were there: a NaN's among them now and then), not a value
# computed: a layer built inside the recording fills its torch.empty weights in place afterwards
_UNWRITTEN = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
                        "resize_"})
_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_frame() -> str | None:
    """`file:line` of the innermost frame outside torch and graphviz_core (the line that called the op)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and not name.startswith(_OWN_DIR) and not name.startswith("<"):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _counts(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, ±inf count) of a floating tensor; (0, 0) for any other."""
    if not (t.is_floating_point() or t.is_complex()) or t.is_meta or t.numel() == 0:
        return 0, 0
    with torch.no_grad():
        return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


class _ForwardCheck(TorchFunctionMode):
    """Every torch function the forward calls (a nested call inside one is not seen again: the outermost op, e.g.
    `softmax`, is the one named): its outputs' NaN and inf counts, and its autograd node's source line."""

    def __init__(self, watch: DebugWatch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.compiler.is_compiling():  # dynamo tracing a region: no check, and no graph break (the eager replay,
            return out                     # record(eager=True), checks the region's ops one by one)
        watch = self.watch
        name = getattr(func, "__name__", "")
        if not torch.is_grad_enabled() or watch.depth or name in _ACCESSORS or name in _UNWRITTEN:
            return out
        if func in FUNCTIONAL_RELUS and not (watch.stack and isinstance(watch.stack[-1], RELU_FAMILY)):
            watch.functional_relu(out)
        outputs = _tensors(out)
        where = None
        for t in outputs:
            node = t.grad_fn
            if node is not None and id(node) not in watch.sources:
                where = where or _user_frame()
                watch.sources[id(node)] = (node, where)
        if watch.producers.get("nan") and watch.producers.get("inf"):
            return out
        bad = [_counts(t) for t in outputs if isinstance(t, torch.Tensor)]
        nan, inf = sum(b[0] for b in bad), sum(b[1] for b in bad)
        if not nan and not inf:
            return out
        inputs = _tensors(args) + _tensors(kwargs or {})
        before = [_counts(t) for t in inputs]
        for kind, count, had in (("nan", nan, sum(b[0] for b in before)), ("inf", inf, sum(b[1] for b in before))):
            if count and not had and kind not in watch.producers:
                watch.producers[kind] = {
                    "op": getattr(func, "__name__", str(func)), "module": watch.current_module(),
                    "source": where or _user_frame(), "nan": nan, "inf": inf,
                    "outputs": [list(t.shape) for t in outputs], "inputs": [list(t.shape) for t in inputs],
                }
                # the autograd node the op made (its backward), placed in the walked graph when a backward runs
                made = next((t.grad_fn for t in outputs if t.grad_fn is not None), None)
                if made is not None:
                    watch.producer_nodes[kind] = made
        return out


class DebugWatch:
    """Installed and removed with the recorder; `backward(probe, roots)` before each recorded backward runs,
    `end_step(...)` when the recorder writes a step."""

    def __init__(self, recorder, check_forward: bool) -> None:
        self.recorder = recorder
        self.check_forward = check_forward
        self.handles: list = []
        self.stack: list = []  # modules whose forward is running (innermost last)
        self.depth = 0  # > 0 inside our own reads
        self.file = None
        self.original_detach = None
        self.mode: _ForwardCheck | None = None
        self.written_sources: set[str] = set()
        self.written_shapes: set[tuple[str, str]] = set()
        self.pending: list[dict] = []  # lines waiting for the rank's folder (opened at the first step)
        self.owning: set[int] = set()  # ids of the modules that hold parameters themselves (refreshed each step)
        self.outermost: set[int] = set()
        self._reset()

    def _reset(self) -> None:
        self.calls: dict[int, dict] = {}  # id(module) -> {"grad": bool, "nograd": bool, "reached": bool, ...}
        self.outputs: list = []  # (id(module), grad_fn) of this backward's window
        self.detached: list = []  # (grad_fn whose tensor was detached, the autograd sequence number then)
        self.backwards = 0  # backwards recorded in this step so far
        # bool mask of units seen non-zero: by id(module) for a ReLU module, by label for a functional ReLU
        self.dead: dict[int | str, torch.Tensor] = {}
        self.relu_calls: dict[str, int] = {}  # functional ReLU calls per module in the current forward
        self.sources: dict[int, tuple] = {}
        self.producers: dict[str, dict] = {}
        self.producer_nodes: dict[str, object] = {}  # kind -> the autograd node the producing op made
        self.losses: list = []
        self.shape_keys: list[str] = []  # per walked backward of the step: the key of its `link_shapes` line
        self.saved_of: list[dict] = []  # per walked backward: {row: its saved tensors' figures} (record_hooks)
        self.zero_beside: dict[int, tuple] = {}  # id(param) -> (name, weakref) of the all-zero weight beside it

    # ---- installing ---------------------------------------------------------------------------------------------
    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.owning = {id(m) for m in self._owners().values()}
        self.handles = [register_module_forward_pre_hook(self._pre),
                        register_module_forward_hook(self._post, always_call=True)]
        self.original_detach = torch.Tensor.detach
        watch, original = self, self.original_detach

        def detach(tensor):
            node = tensor.grad_fn
            if node is not None and len(watch.detached) < MAX_DETACHED and not watch.depth \
                    and not torch.compiler.is_compiling():
                watch.detached.append((node, _get_sequence_nr()))
            return original(tensor)

        torch.Tensor.detach = detach
        if self.check_forward:
            self.mode = _ForwardCheck(self)
            self.mode.__enter__()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.original_detach is not None:
            torch.Tensor.detach = self.original_detach
            self.original_detach = None
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
        if self.file is not None:
            self.file.close()
            self.file = None
        self._reset()

    def stop(self) -> None:
        """The recorder stopped recording (its step limit): the loop runs on without our hooks."""
        self.remove()

    # ---- forward ------------------------------------------------------------------------------------------------
    def current_module(self) -> str:
        paths = self.recorder.modules.paths
        for module in reversed(self.stack):
            known = paths.get(id(module))
            if known is not None:
                return known[0]
        return ""

    def _pre(self, module, args) -> None:
        if torch.compiler.is_compiling():  # inside code dynamo traces: nothing watched, and no graph break added
            return
        if not self.stack:
            self.relu_calls = {}  # a forward starts: functional ReLUs are numbered again within each module
        if not self.stack and id(module) not in self.outermost:  # an outermost module first seen (the model)
            self.outermost.add(id(module))
            self.owning |= {id(m) for m in module.modules() if next(m.parameters(recurse=False), None) is not None}
        self.stack.append(module)

    def _post(self, module, args, output) -> None:
        if torch.compiler.is_compiling():
            return
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        if self.depth or not self.recorder.active:
            return
        relu = isinstance(module, RELU_FAMILY)
        if not relu and id(module) not in self.owning:
            return
        entry = self.calls.setdefault(id(module), {"grad": False, "nograd": False, "reached": False,
                                                  "detached": None, "output": False, "after": None, "cut": None})
        if not torch.is_grad_enabled():
            entry["nograd"] = True
            entry["after"] = _get_sequence_nr()  # the ops after it made the nodes from here on
            return
        entry["grad"] = True
        outs = _tensors(output)
        node = next((t.grad_fn for t in outs if t.grad_fn is not None), None)
        if node is not None:
            entry["output"] = True
            if not entry["reached"]:
                self.outputs.append((id(module), node))
        if relu and outs:
            self._units_seen(id(module), outs[0])

    def functional_relu(self, out) -> None:
        """A functional ReLU's output (F.relu in a module's forward): its units seen non-zero, keyed by the calling
        module and the call's order within it ("mlp (F.relu 1)")."""
        if not isinstance(out, torch.Tensor):
            return
        path = self.current_module()
        count = self.relu_calls.get(path, 0) + 1
        self.relu_calls[path] = count
        self._units_seen(f"{path or '(model)'} (F.relu {count})", out)

    def _units_seen(self, key: int | str, out: torch.Tensor) -> None:
        """The units (positions of the last dimension) of a ReLU's output seen non-zero so far this step, kept under
        `key`: a ReLU module's id, or a functional ReLU's label."""
        if out.dim() < 1 or out.is_meta:
            return
        self.depth += 1
        try:
            with torch.no_grad():
                alive = (out != 0).reshape(-1, out.shape[-1]).any(0)
            seen = self.dead.get(key)
            self.dead[key] = alive if seen is None or seen.shape != alive.shape else seen | alive
        finally:
            self.depth -= 1

    # ---- backward -----------------------------------------------------------------------------------------------
    def backward(self, probe, roots: list) -> None:
        """Before a recorded backward: which module outputs it reaches, which detaches cut one; the nodes' forward
        source lines for a graph not seen before."""
        self.depth += 1
        try:
            for root in roots:
                if isinstance(root, torch.Tensor) and root.numel() == 1:
                    value = float(root.detach())
                    self.losses.append(None if math.isfinite(value) else str(value))
            walked = {id(n) for n in probe.nodes}
            cut = [(m, node) for m, node in self.outputs if id(node) not in walked]
            for m, node in self.outputs:
                if id(node) in walked:
                    self.calls[m]["reached"] = True
            detached = [(d, at) for d, at in self.detached if id(d) not in walked]  # a cut's node is not walked
            if cut and detached:
                for d, at in detached:
                    below = _reachable(d)
                    for m, node in cut:
                        if id(node) in below and self.calls[m]["detached"] is None:
                            self.calls[m]["detached"] = _name(d)
                            self.calls[m]["after"] = at
            for kind, made in list(self.producer_nodes.items()):  # the forward's NaN or inf op, as a node here
                row = next((i for i, n in enumerate(probe.nodes) if n is made), None)
                if row is not None and kind in self.producers:
                    self.producers[kind]["at"] = {"backward": self.backwards, "row": row, "op": _name(made)}
                    del self.producer_nodes[kind]
            for entry in self.calls.values():  # where each cut output would have entered the graph
                if entry["after"] is not None and entry["cut"] is None and (entry["detached"] or not entry["grad"]):
                    entry["cut"] = _cut_at(probe.nodes, entry["after"], self.backwards)
            shapes, dtypes = link_shapes(probe.edge_inputs)
            key = hashlib.blake2b(json.dumps([shapes, dtypes]).encode(), digest_size=8).hexdigest()
            if (probe.id, key) not in self.written_shapes:
                self._line({"link_shapes": probe.id, "key": key, "shapes": shapes, "dtypes": dtypes})
                self.written_shapes.add((probe.id, key))
            self.shape_keys.append(key)
            probe.read_saved = True  # filled by the probe's hooks as the backward runs
            self.saved_of.append(probe.sources)
            self.backwards += 1
            self.outputs, self.detached = [], []
            if self.check_forward and probe.id not in self.written_sources:
                rows = {str(i): self.sources[id(n)][1] for i, n in enumerate(probe.nodes)
                        if id(n) in self.sources and self.sources[id(n)][1]}
                self._line({"sources": probe.id, "rows": rows})
                self.written_sources.add(probe.id)
            self.sources = {}
        finally:
            self.depth -= 1

    def backward_failed(self) -> None:
        """The backward announced last raised (the user may catch it and go on): the step's figures keep no trace of
        it, so the next backward's shapes and saved values stay beside its own graph."""
        if self.backwards:
            self.backwards -= 1
            self.shape_keys = self.shape_keys[:self.backwards]
            self.saved_of = self.saved_of[:self.backwards]

    # ---- the step -----------------------------------------------------------------------------------------------
    def end_step(self, index: int, params: list, grads: list, sampled: bool = True) -> None:
        """The step is written: its no-gradient parameters with their reasons, dead units, forward producers. A step
        without per-node figures (`sampled` False: record's nodes_every) names no parameter: the reasons are read from
        the walked graph."""
        self.depth += 1
        try:
            got = {id(p): g for p, g in zip(params, grads, strict=False)}
            names = self.recorder.modules.param_names
            owners = self._owners()
            self.owning = {id(m) for m in owners.values()}
            missing = []
            for p in self.recorder._known_parameters() if sampled else ():
                if not p.requires_grad:
                    continue
                norm = got.get(id(p))
                if norm is not None and norm != 0:
                    continue
                if norm is None and p.grad is not None:
                    continue  # not stepped by the optimizer, but it has a gradient
                name = names.get(id(p), "")
                module = owners.get(id(p))
                beside = self.zero_beside.get(id(p))
                if beside is not None and beside[1]() is not None and bool(beside[1]().detach().any()):
                    continue  # zero beside a zero weight the optimizer has just moved: LoRA's first step, expected
                reason, is_cut = self._reason(module, zero=norm == 0, beside=beside[0] if beside is not None else None)
                entry = self.calls.get(id(module)) if module is not None else None
                cut = entry.get("cut") if entry is not None and is_cut else None
                missing.append({"parameter": name, "module": self._path(module), "reason": reason,
                                **({"cut": cut} if cut else {})})
            dead = {}
            for key, alive in self.dead.items():
                known = (key,) if isinstance(key, str) else self.recorder.modules.paths.get(key)
                if known is not None:
                    dead[known[0]] = [int(alive.numel() - int(alive.sum())), int(alive.numel())]
            self._line({"step": index, "no_gradient": missing, "dead_units": dead, "losses": self.losses,
                        "forward": self.producers, "link_shapes": self.shape_keys,
                        "saved_values": [{str(row): v for row, v in found.items()} for found in self.saved_of]})
        finally:
            self.depth -= 1
        self._reset()

    def _owners(self) -> dict[int, torch.nn.Module]:
        owners = {}
        for ref in self.recorder.modules.roots:
            root = ref()
            for module in (root.modules() if root is not None else ()):
                for p in module.parameters(recurse=False):
                    owners.setdefault(id(p), module)
        return owners

    def _path(self, module) -> str:
        known = self.recorder.modules.paths.get(id(module)) if module is not None else None
        return known[0] if known else ""

    def before_update(self, params: list, grads: list) -> None:
        """Before the optimizer's step: for each parameter whose gradient is exactly zero, the all-zero weight beside
        it (LoRA's B beside its A), read while the step has not moved it yet. At the step's end a zero gradient beside
        a weight the step moved is expected and not a finding; beside one that stayed zero (B frozen, or a learning
        rate of 0) A never learns, and that is the finding."""
        zero = [p for p, norm in zip(params, grads, strict=False) if norm == 0]
        if not zero:
            return
        self.depth += 1
        try:
            owners = self._owners()
            for p in zero:
                found = self._zero_neighbour(owners.get(id(p)), with_tensor=True)
                if found is not None:
                    self.zero_beside[id(p)] = (found[0], weakref.ref(found[1]))
        finally:
            self.depth -= 1

    def _reason(self, module, zero: bool, beside: str | None = None) -> tuple[str, bool]:
        """Why the parameter of `module` got no gradient, and whether that is a cut placed in the graph (a detach or a
        no_grad: the node the cut output entered, _cut_at)."""
        path = self._path(module) or "its module"
        if zero:
            beside = beside or self._zero_neighbour(module)
            if beside:
                return (f"its gradient is exactly zero: the gradient reaches it through {beside}, whose values are "
                        f"all zero (LoRA's B starts at zero: A's gradient stays zero until B moves)"), False
            return "its gradient is exactly zero: every path from the loss to it carried zeros", False
        entry = self.calls.get(id(module)) if module is not None else None
        if entry is None:
            return f"not on any path from the loss: {path} never ran in this step's forward", False
        entered = f"; it entered the graph at {entry['cut']['op']}" if entry.get("cut") else ""
        if entry["nograd"] and not entry["grad"]:
            return f"computed under no_grad: {path}'s forward ran with gradients off{entered}", True
        if entry["detached"]:
            return (f"cut by detach: the output of {path} was detached (at {entry['detached']}) before the "
                    f"loss{entered}"), True
        if entry["grad"] and not entry["output"]:
            return (f"requires_grad=False upstream: {path}'s output needed no gradient (its inputs and weights, as "
                    f"used, do not require one)"), False
        return f"not on any path from the loss: the output of {path} never reached it", False

    def _zero_neighbour(self, module, with_tensor: bool = False):
        """A weight matrix near `module` (under its parent or grandparent, never the whole model) whose values are
        all zero: a zero-initialised LoRA B beside its A. Biases (often zero at initialisation) are not counted."""
        path = self._path(module)
        if not path:
            return None
        names = self.recorder.modules.param_names
        ancestors = [path.rpartition(".")[0], path.rpartition(".")[0].rpartition(".")[0]]
        for ref in self.recorder.modules.roots:
            root = ref()
            if root is None:
                continue
            for prefix in [a for a in ancestors if a]:
                try:
                    near = root.get_submodule(prefix)
                except AttributeError:
                    continue
                for p in near.parameters():
                    name = names.get(id(p), "")
                    if not name.startswith(path + ".") and p.dim() >= 2 and p.numel() and not bool(p.detach().any()):
                        return (name, p) if with_tensor else name
        return None

    def _parameters(self) -> None:
        rows = []
        names = self.recorder.modules.param_names
        for p in self.recorder._known_parameters():
            rows.append({"name": names.get(id(p), ""), "requires_grad": bool(p.requires_grad),
                         "shape": list(p.shape)})
        self._line({"parameters": rows})

    def _line(self, data: dict) -> None:
        if self.file is None:
            folder = getattr(self.recorder.writer, "folder", None)
            if folder is None or self.recorder.writer.rank is None:
                self.pending.append(data)
                return
            self.file = open(folder / DEBUG_FILE, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the run)
            pending, self.pending = self.pending, []
            if "parameters" not in data:
                self._parameters()
            for line in pending:
                self._line(line)
        self.file.write(json.dumps(data, allow_nan=False, separators=(",", ":")) + "\n")
        self.file.flush()


def link_shapes(edge_inputs: list) -> tuple[list, list]:
    """The shape and dtype of the gradient each edge of the walked graph carries (record_hooks.walk's edges, given as
    the node each sends to and that node's input number): the gradient of that input, by autograd's metadata of it
    (the shape the engine checks the gradient against). None where autograd keeps no plain shape (a nested tensor)."""
    shapes, dtypes = [], []
    for child, number in edge_inputs:
        try:
            meta = child._input_metadata[number]
            shapes.append([int(d) for d in meta.shape])
            dtypes.append(str(meta.dtype).removeprefix("torch."))
        except (RuntimeError, IndexError, AttributeError, TypeError):
            shapes.append(None)
            dtypes.append(None)
    return shapes, dtypes


def _cut_at(nodes: list, after: int, backward: int) -> dict | None:
    """The node a cut output most likely entered: of the walked `nodes`, the first made after the cut (autograd's
    sequence numbers count the nodes a thread makes, in order) that took an input needing no gradient (a None among
    its next_functions). `h = base(x) + adapter(x).detach()`: the add. None where no such node follows."""
    best = None
    for row, node in enumerate(nodes):
        if node.name() == "torch::autograd::AccumulateGrad":
            continue
        number = node._sequence_nr()
        if number >= after and any(f is None for f, _ in node.next_functions) and (best is None or number < best[0]):
            best = (number, row, node)
    if best is None:
        return None
    return {"backward": backward, "row": best[1], "op": _name(best[2])}


def _name(node) -> str:
    from graphviz_core.graph.categories import normalise_op

    return normalise_op(node.name())


def _reachable(node, limit: int = 100_000) -> set[int]:
    """ids of every node reachable from `node` through next_functions (the graph above a detach)."""
    seen, stack = set(), [node]
    while stack and len(seen) < limit:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        stack.extend(child for child, _ in n.next_functions if child is not None)
    return seen
