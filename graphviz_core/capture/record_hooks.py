"""The recorder's instruments on a user's loop (graphviz_core.capture.recorder runs them):

- `ModuleCalls`: process-wide module forward hooks; which module's forward created each autograd node (autograd's
  sequence numbers, as capture.instruments.modules reads them) and each parameter's fully qualified name;
- `BackwardProbe`: one backward call: the walk from its roots, the graph's identity (its ops and edges), a pre and a
  post hook on every node (gradient-out L2 norm, max |value|, non-finite count, wall time), and for a graph not seen
  before its structure in graph/schema.py's records, with saved bytes (read from each node's raw saved fields, never
  unpacked) and backward FLOPs (one dispatch mode during that first backward only).
"""

from __future__ import annotations

import hashlib
import math
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphviz_core.capture.flop_formulas import op_info
from graphviz_core.capture.walk import autograd_nodes, next_sequence_nr
from graphviz_core.graph.categories import category_in_module, normalise_op
from graphviz_core.graph.recording import json_number
from graphviz_core.graph.schema import NodeRecord

MAX_CALLS = 200_000  # module calls kept between two backwards (forwards with no backward keep none past this)


class ModuleCalls:
    """Global module forward hooks while the recorder runs: the range of autograd sequence numbers each module call
    gave out, innermost found by painting outermost first (capture.instruments.modules does the same)."""

    def __init__(self, model: torch.nn.Module | None, track_calls: bool = True) -> None:
        self.model = model
        self.track_calls = track_calls  # False: only learn the outermost modules (parameter names), no attribution
        self.paths: dict[int, tuple[str, str]] = {}  # id(module) -> (path, type name)
        self.param_names: dict[int, str] = {}  # id(parameter) -> fully qualified name
        self.roots: list = []  # weak references to the outermost modules seen (the model, a loss module)
        if model is not None:
            self._adopt(model)
        self.open: list[int] = []
        self.calls: list[tuple[int, int, int, str]] = []
        self.handles: list = []

    def _adopt(self, root: torch.nn.Module) -> None:
        self.roots.append(weakref.ref(root))
        for path, module in root.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(module), (path, type(module).__name__))
        for name, param in root.named_parameters(remove_duplicate=False):
            self.param_names.setdefault(id(param), name)

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.handles = [register_module_forward_pre_hook(self.pre), register_module_forward_hook(self.post,
                                                                                                 always_call=True)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def pre(self, module, args) -> None:
        if torch.compiler.is_compiling():  # inside code dynamo traces: no call recorded, and no graph break added
            return
        if not torch.is_grad_enabled():
            self.open.append(-1)
            return
        if not self.open and self.model is None and id(module) not in self.paths:
            self._adopt(module)  # an outermost module not seen before: the user's model (or its loss module)
        self.open.append(next_sequence_nr())

    def post(self, module, args, output) -> None:
        if torch.compiler.is_compiling() or not self.open:
            return
        start = self.open.pop()
        known = self.paths.get(id(module))
        if start < 0 or known is None or not self.track_calls or len(self.calls) >= MAX_CALLS:
            return
        self.calls.append((len(self.open), start, next_sequence_nr(), known[0]))

    def labels(self, nodes: list) -> list[tuple[str, str]]:
        """(module path, module type name) of each node ("" where no module of the model created it)."""
        types = {path: kind for path, kind in self.paths.values()}
        if not self.calls:
            return [("", "")] * len(nodes)
        base = min(c[1] for c in self.calls)
        size = max(c[2] for c in self.calls) - base
        owner: list[str | None] = [None] * max(size, 0)
        for _depth, start, end, path in sorted(self.calls, key=lambda c: c[0]):
            owner[start - base:end - base] = [path] * (end - start)
        out = []
        for node in nodes:
            index = node._sequence_nr() - base
            path = owner[index] if 0 <= index < size else None
            out.append(("", "") if path is None else (path, types.get(path, "")))
        return out

    def clear(self) -> None:
        self.calls = []


def walk(roots: list) -> tuple[list, list[str], list[tuple[int, int]], list[tuple]]:
    """Every node reachable from the roots' grad_fn, in pre-order; their op names; the edges as index pairs; and per
    edge the node it sends a gradient to with that node's input number (the gradient's place: its shape is there)."""
    order = autograd_nodes(*roots)
    index = {node: i for i, node in enumerate(order)}
    sent = [(node, child, number) for node in order for child, number in node.next_functions if child is not None]
    return order, [normalise_op(n.name()) for n in order], [(index[a], index[b]) for a, b, _ in sent], \
        [(child, number) for _, child, number in sent]


def graph_id(ops: list[str], edges: list[tuple[int, int]]) -> str:
    digest = hashlib.blake2b(digest_size=10)
    digest.update("\n".join(ops).encode())
    digest.update(repr(edges).encode())
    return digest.hexdigest()


def _storage_of(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the storage holding `t`'s values in this process: a DTensor's (FSDP2, tensor parallel)
    local shard's. None where there is none to read (another wrapper subclass)."""
    try:
        if hasattr(t, "to_local"):
            t = t.to_local()
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _raw_saved(node):
    """(field name, tensor) for each tensor saved for `node`'s backward, read from its raw saved fields: a tensor packed
    by a saved-tensor hook (checkpointing) is left out, never unpacked (unpacking one runs its forward again)."""
    for name in dir(node):
        if not name.startswith("_raw_saved_"):
            continue
        try:
            raw = getattr(node, name)
        except RuntimeError:  # freed, or undefined for this node
            continue
        for item in raw if isinstance(raw, (list, tuple)) else (raw,):
            data = getattr(item, "data", None)
            if isinstance(data, torch.Tensor):
                yield name.removeprefix("_raw_saved_"), data


def _saved_of(node, parameter_storages: set[int]) -> list[dict]:
    """The tensors saved for `node`'s backward: shape, dtype, the bytes of their storage (once per storage)."""
    out = []
    for _, data in _raw_saved(node):
        found = _storage_of(data)
        if found is not None:
            key, size = found
            out.append({"shape": list(data.shape), "dtype": str(data.dtype).removeprefix("torch."),
                        "bytes": size, "key": key, "parameter": key in parameter_storages})
    return out


MAX_SOURCES = 8  # nodes of one backward whose saved tensors' values are read (a NaN's sources; the first is named)


def saved_values(node) -> list[dict]:
    """The shape, dtype, smallest and largest value and non-finite count of each tensor saved for `node`, read from
    its raw saved fields inside its post hook (still held there); one packed by a saved-tensor hook (checkpointing)
    is left out, never unpacked. Runs only for a node that returned a non-finite gradient from finite ones."""
    out = []
    for name, data in _raw_saved(node):
        if data.is_meta or hasattr(data, "to_local"):
            continue
        figures = {"name": name, "shape": list(data.shape), "dtype": str(data.dtype).removeprefix("torch."),
                   "min": None, "max": None, "nonfinite": None}
        # values of a plain dense tensor only (a sparse or mkldnn one, a subclass such as NF4: its shape alone); a
        # kernel this dtype lacks (aminmax of float8) leaves them null: the user's backward never fails for a figure
        plain = data.layout == torch.strided and type(data) in (torch.Tensor, torch.nn.Parameter)
        if plain and data.numel() and not data.is_complex() and data.dtype != torch.bool:
            try:
                flat = data.detach().reshape(-1)
                low, high = torch.aminmax(flat)
                figures["min"], figures["max"] = json_number(low.item()), json_number(high.item())
                figures["nonfinite"] = int(flat.numel() - int(torch.isfinite(flat).sum())) \
                    if data.is_floating_point() else 0
            except (RuntimeError, NotImplementedError, TypeError):
                figures["min"] = figures["max"] = figures["nonfinite"] = None
        out.append(figures)
    return out


def _same_values_key(g: torch.Tensor) -> tuple | None:
    """A key equal for every dense view of the same elements (a transpose, a reshape): where the elements start, how
    many, the dtype. None for a view that skips or repeats elements (its values are not the same set)."""
    if g.is_sparse:
        return None
    expected = 1
    for size, stride in sorted(zip(g.shape, g.stride(), strict=True), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:  # a gap, an overlap or a negative stride: not every element once, in memory order
            return None
        expected *= size
    return ("dense", g.device.type, g.data_ptr(), g.numel(), g.dtype)


class _Flops(TorchDispatchMode):
    """FLOPs of each node's backward (the project's formulas, capture.flop_formulas), on a new graph's first backward."""

    def __init__(self, probe: BackwardProbe) -> None:
        super().__init__()
        self.probe = probe

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula, _ = op_info(func)
        current = self.probe.current
        if formula is not None and current is not None:
            self.probe.flops[current] += int(formula(*args, out_val=out, **kwargs))
        return out


COUNT_CHUNK = 1 << 22  # values per non-finite count on the GPU (see nonfinite_count)


def nonfinite_count(flat: torch.Tensor) -> torch.Tensor:
    """How many of a flat gradient's values are NaN or inf, a 0-dim tensor on its device (on a GPU read after the
    backward: no synchronisation per node). Counted 4,194,304 values at a time: `isfinite` makes one boolean per value and summing
    booleans makes an integer copy of them, so a whole 51-million-value logits gradient at once held 441.7 MiB of
    temporaries at the step's peak (gpt2-small, b=4, s=256, on an H200); a chunk holds 4 MiB + 16 MiB (int32)."""
    parts = [part.numel() - torch.isfinite(part).sum(dtype=torch.int32) for part in flat.split(COUNT_CHUNK)]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


class BackwardProbe:
    """One backward: hooks on every node of the walked graph; `figures()` after it ran."""

    def __init__(self, roots: list, modules: ModuleCalls, new_graphs: set[str], cuda: bool) -> None:
        self.nodes, self.ops, edges, self.edge_inputs = walk([getattr(r, "grad_fn", None) for r in roots])
        self.edges = edges
        self.id = graph_id(self.ops, edges)
        self.new = self.id not in new_graphs
        self.modules = modules
        self.cuda = cuda
        count = len(self.nodes)
        self.started = [0.0] * count
        self.elapsed: list = [None] * count
        self.norms: list = [None] * count  # per node: [(l2, max_abs, nonfinite)] tensors, read after the backward
        self.flops = [0] * count
        self.current: int | None = None
        self.leaf = [op == "AccumulateGrad" for op in self.ops]
        self.seen: dict[int, tuple] = {}
        # set by the gradient-flow watch (capture.nonfinite): on the CPU, for up to MAX_SOURCES nodes that return a
        # non-finite gradient from finite ones, the figures of the tensors saved for them ({row: [figures]})
        self.read_saved = False
        self.sources: dict[int, list] = {}
        self.structure = self._structure() if self.new else None
        self.handles = []
        for i, node in enumerate(self.nodes):
            self.handles.append(node.register_prehook(self._pre(i)))
            self.handles.append(node.register_hook(self._post(i)))

    def _structure(self) -> dict:
        """The graph's node-link JSON in graph/schema.py's records (bytes saved counted once per storage, at its
        first save in pre-order, parameters excluded); FLOPs are filled after the backward."""
        labels = self.modules.labels(self.nodes)
        names = self.modules.param_names
        counted: set[int] = set()
        parameters = [n.variable for n, op in zip(self.nodes, self.ops, strict=True) if op == "AccumulateGrad"]
        for ref in self.modules.roots:  # frozen parameters too (no AccumulateGrad node)
            root = ref()
            parameters += list(root.parameters()) if root is not None else []
        storages = {found[0] for found in map(_storage_of, parameters) if found is not None}
        records = []
        for i, node in enumerate(self.nodes):
            op = self.ops[i]
            module, kind = labels[i]
            param = None
            if op == "AccumulateGrad":
                variable = node.variable
                name = names.get(id(variable), "")
                param = {"name": name, "shape": list(variable.shape)}
                module = name.rpartition(".")[0]
            saved = []
            saved_bytes = 0
            for item in _saved_of(node, storages):
                key = item.pop("key")
                item["counted"] = not item["parameter"] and key not in counted
                if item["counted"]:
                    counted.add(key)
                    saved_bytes += item["bytes"]
                saved.append(item)
            record = NodeRecord(op=op, category=category_in_module(op, kind), module=module, saved_bytes=saved_bytes,
                                param=param, saved=saved).to_dict()
            records.append({"id": f"{op}:{i}", **record})
        return {"directed": True, "multigraph": False, "graph": {}, "nodes": records,
                "links": [{"source": records[a]["id"], "target": records[b]["id"]} for a, b in self.edges]}

    def flop_mode(self):
        return _Flops(self)

    def _clock(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _pre(self, i: int):
        def hook(grad_outputs):
            self.current = i
            self.started[i] = self._clock()

        return hook

    def _post(self, i: int):
        def hook(grad_inputs, grad_outputs):
            end = self._clock()
            self.elapsed[i] = (self.started[i], end)
            self.current = None
            with torch._C._DisableTorchDispatch():
                self.norms[i] = [self._figures(g) for g in (grad_outputs if self.leaf[i] else grad_inputs)
                                 if g is not None]
                if self.read_saved and not self.cuda and not self.leaf[i] and len(self.sources) < MAX_SOURCES \
                        and any(f[3] for f in self.norms[i]) \
                        and not any(self._figures(g)[3] for g in grad_outputs if g is not None):
                    self.sources[i] = saved_values(self.nodes[i])

        return hook

    def _figures(self, g: torch.Tensor) -> tuple:
        """(L2, min, max, non-finite count) of one gradient, the first three 0-dim tensors read after the backward in
        one transfer; read once per tensor object (an add sends one gradient down two edges). On the CPU the count is
        taken only where the L2 norm is not finite (every value is finite otherwise)."""
        seen = self.seen.get(id(g))
        if seen is not None and seen[0]() is g:
            return seen[1]
        same = _same_values_key(g)  # a transpose or reshape of a gradient read already: the same values
        if same is not None:
            seen = self.seen.get(same)
            if seen is not None and seen[0]() is not None:
                return seen[1]
        key = g
        if g.is_sparse:
            g = g.coalesce().values()
        if g.numel() == 0:
            zero = torch.zeros((), device=g.device)
            return zero, zero, zero, 0
        # aminmax walks a transposed tensor element by element (an lm_head weight's gradient: 237 ms against 9 ms
        # contiguous, on one CPU thread): a dense view's elements are read in memory order instead, a flat view of them.
        flat = g.as_strided((g.numel(),), (1,)) if same is not None else g.reshape(-1)
        l2 = torch.linalg.vector_norm(flat, dtype=torch.float32)
        low, high = torch.aminmax(flat.abs() if g.is_complex() else flat)  # NaN if any is NaN
        if self.cuda:
            bad = nonfinite_count(flat)
        else:
            bad = 0 if math.isfinite(l2.item()) else int(nonfinite_count(flat))
        figures = (l2, low.float(), high.float(), bad)
        self.seen[id(key)] = (weakref.ref(key), figures)
        if same is not None:
            self.seen[same] = (weakref.ref(key), figures)  # while it lives, its storage is not another tensor's
        return figures

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def figures(self, scale: float) -> tuple[dict, float | None]:
        """The NODES columns of this backward (gradients divided by the GradScaler's `scale`) and the L2 norm of the
        gradient that reached the parameters (the AccumulateGrad nodes': this micro-batch's contribution)."""
        flat = [f for parts in self.norms if parts for f in parts]
        read = torch.stack([torch.stack([f[i] for f in flat]) for i in range(3)]).tolist() if flat else [[], [], []]
        # (L2, max |value|, min, max) per gradient, NaN kept: a NaN anywhere makes aminmax's both ends NaN
        values = [(l2, math.nan if low != low or high != high else abs(max(-low, high)), low, high)  # abs: not -0.0
                  for l2, low, high in zip(*read, strict=True)]
        counts = [int(f[3]) for f in flat]
        grad_norm, max_abs, nonfinite, times, lows, highs = [], [], [], [], [], []
        at = 0
        into_parameters = None
        for i, parts in enumerate(self.norms):
            if not parts:
                grad_norm.append(None)
                max_abs.append(None)
                lows.append(None)
                highs.append(None)
                nonfinite.append(None if parts is None else 0)
            else:
                mine = values[at:at + len(parts)]
                grad_norm.append(math.sqrt(sum(v[0] ** 2 for v in mine)) / scale)
                finite = all(v[1] == v[1] for v in mine)
                max_abs.append(max(v[1] for v in mine) / scale if finite else math.nan)
                # the scale is positive: dividing by it keeps the order, so the ends of the unscaled gradient
                lows.append(min(v[2] for v in mine) / scale if finite else math.nan)
                highs.append(max(v[3] for v in mine) / scale if finite else math.nan)
                nonfinite.append(sum(counts[at:at + len(parts)]))
                if self.leaf[i]:
                    into_parameters = (into_parameters or 0.0) + grad_norm[-1] ** 2
                at += len(parts)
            span = self.elapsed[i]
            if span is None:
                times.append(None)
            elif self.cuda:
                times.append(span[0].elapsed_time(span[1]) / 1000.0)
            else:
                times.append(span[1] - span[0])
        if self.structure is not None:
            for record, flops in zip(self.structure["nodes"], self.flops, strict=True):
                record["flops"] = flops
        columns = {"grad_norm": grad_norm, "max_abs": max_abs, "nonfinite": nonfinite, "time_s": times, "min": lows,
                   "max": highs}
        return columns, (math.sqrt(into_parameters) if into_parameters is not None else None)

    def release(self) -> None:
        self.remove()
        self.nodes = []
        self.norms = []
        self.seen.clear()
