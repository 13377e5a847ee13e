"""The step under torch.compile, opened: each compiled region's backward graph, what it saves and what it recomputes.

`torch.compile` hands the backward one `CompiledFunctionBackward` autograd node per compiled region (dynamo starts a
new region at every graph break). This instrument compiles the model with AOTAutograd and inductor's own partitioner
(`torch._inductor.compile_fx.partition_fn`: inductor's joint-graph passes, then `min_cut_rematerialization_partition`,
over inductor's decompositions), so the tensors saved between the compiled forward and backward are the ones a
training run with `torch.compile` keeps; it generates no code: the partitioned FX graphs run as Python calls to aten
ops, which the other instruments watch as usual. Each compiled node of the captured graph gets a `compiled` field: its
backward FX graph (nodes with ops, shapes, bytes and inputs), the saved tensors and the forward ops it recomputes.

Dynamo's caches are process-wide: compiled captures take turns (`exclusive`) and reset dynamo before and after.
Importing this module imports torch._dynamo and inductor's Python (seconds): only a compiled capture does.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.compile_fx import partition_fn as inductor_partition_fn
from torch._inductor.decomposition import select_decomp_table

from graphviz_core.capture.instrument import Instrument, Run
from graphviz_core.graph.categories import category_of

PARTITIONER = ("inductor's partitioner: torch._inductor.compile_fx.partition_fn (inductor's joint-graph passes, then "
               "min_cut_rematerialization_partition) over inductor's decompositions")
NO_CODEGEN = ("no code generated: the partitioned forward and backward FX graphs run as Python calls to aten ops, "
              "so times are not inductor's kernels; the graphs and the saved tensors are the ones inductor compiles")
COMPILED_OP = "CompiledFunctionBackward"

_LOCK = threading.Lock()  # dynamo's caches and counters are the process's: one compiled capture at a time


def check_compile(config, device: str) -> None:
    """Refuse what a compiled capture does not do, with the fix."""
    if device == "meta":
        raise ValueError("--compile runs the compiled step on real tensors; use --device cpu or cuda, or drop --compile.")
    if config.autocast != "none":
        raise ValueError("--compile with --autocast is not captured; drop one of them (--autocast none or no --compile).")
    if config.checkpoint != "none":
        raise ValueError("--compile with checkpointing is not captured; use --checkpoint none or drop --compile.")


def _no_mode_left_behind() -> None:
    """Clear dynamo's process-wide "a dispatch mode is active" flag, which dispatch modes entered and left in other
    threads out of order leave set (each restores the value it found on entry), and which would make every compiled
    step compile again in the middle of its step. Called while this capture runs alone (step_gate.alone), when no
    capture's mode is active."""
    python_dispatch = torch.utils._python_dispatch
    if python_dispatch._is_in_any_mode_without_ignore_compile_internals and not python_dispatch._get_current_dispatch_mode():
        python_dispatch._is_in_any_mode_without_ignore_compile_internals = False
        python_dispatch.set_is_in_mode_without_ignore_compile_internals(False)


@contextlib.contextmanager
def dynamo_alone() -> Iterator[None]:
    """One compiled capture at a time in this process, each starting and ending with dynamo's caches empty."""
    with _LOCK:
        torch._dynamo.reset()
        _no_mode_left_behind()
        try:
            yield
        finally:
            torch._dynamo.reset()
            gc.collect()  # dynamo's weak-reference clean-ups run here, while no other capture runs


@dataclass
class _Region:
    """One graph dynamo compiled: why it ended, its parameters, and its partitioned forward and backward."""

    index: int
    reason: str
    graph_break: bool
    where: str  # the user's line the graph break is at ("" for none)
    parameter_inputs: set[int]  # positions of the graph's inputs that are parameters (AOT's primals_<i+1>)
    dynamo_ops: int
    forward: dict | None = None
    backward: dict | None = None
    forward_names: set[str] = field(default_factory=set)


class CompiledRegions(Instrument):
    """Compiles the model (the `compile` phase), then maps each CompiledFunctionBackward node to its region."""

    name = "compiled"

    def __init__(self, eager_saved_bytes: int | None = None) -> None:
        self.eager_saved_bytes = eager_saved_bytes
        self.regions: list[_Region] = []
        self.region_of: dict[str, int] = {}
        self.compile_s = 0.0
        self.compiled_during_step = 0
        self.summary: dict = {}

    def exclusive(self) -> contextlib.AbstractContextManager:
        """Held around the whole compiled capture: dynamo's caches are the process's."""
        return dynamo_alone()

    def compile(self, model: torch.nn.Module, inputs: tuple, loss_of: Callable) -> Callable:
        """torch.compile the model and run one uninstrumented step, which compiles every region's forward and
        backward; the measured step then runs the compiled code. Gradients of that step are dropped."""
        started = time.perf_counter()
        backend = aot_autograd(fw_compiler=self._keep("forward"), bw_compiler=self._keep("backward"),
                               partition_fn=inductor_partition_fn, decompositions=select_decomp_table())
        compiled = torch.compile(model, backend=self._noting(backend), dynamic=False)
        loss = loss_of(compiled(*inputs))
        if loss.requires_grad:
            loss.backward()
        del loss
        for tensor in (*model.parameters(), *inputs):
            if isinstance(tensor, torch.Tensor) and tensor.is_leaf:
                tensor.grad = None
        self.compile_s = time.perf_counter() - started
        self.compiled_regions = len(self.regions)
        return compiled

    def _keep(self, side: str) -> Callable:
        """The compiler AOTAutograd calls for each region's forward or backward: record the graph, run it as is."""

        def compiler(graph: torch.fx.GraphModule, example_inputs) -> Callable:
            region = self.regions[-1] if side == "forward" else self._region_of_backward(graph)
            if region is None:  # a backward no region here is waiting for: run it, open nothing
                return make_boxed_func(graph.forward)
            run = make_boxed_func(_ModuleNaming(graph, self).run)
            if side == "forward":
                region.forward = fx_graph(graph, region.parameter_inputs)
                region.forward_names = {n.name for n in graph.graph.nodes if n.op == "call_function"}
            else:
                region.backward = fx_graph(graph, region.parameter_inputs, region.forward_names)
            run.region = region.index
            return run

        return compiler

    def _region_of_backward(self, graph: torch.fx.GraphModule) -> _Region | None:
        """The region a (lazily compiled) backward belongs to: backward runs the regions last first, so the latest
        one still without a backward whose forward returned every tensor this backward takes as saved."""
        saved = {n.name for n in graph.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents_")}
        waiting = [r for r in reversed(self.regions) if r.backward is None and r.forward is not None]
        for region in waiting:
            if saved <= set(region.forward["output_names"]):
                return region
        return waiting[0] if waiting else None

    def _noting(self, backend: Callable) -> Callable:
        """Dynamo's backend: note the graph (why it ended, which inputs are parameters), then AOTAutograd."""

        def note_then_compile(gm, example_inputs):
            self._note(gm, example_inputs)
            return backend(gm, example_inputs)

        return note_then_compile

    def _note(self, gm: torch.fx.GraphModule, example_inputs) -> None:
        # The graph's compile_subgraph_reason is what torch._dynamo.explain reads for its break reasons.
        reason = getattr(gm, "compile_subgraph_reason", None)
        stack = list(getattr(reason, "user_stack", None) or [])
        where = f"{os.path.basename(stack[-1].filename)}:{stack[-1].lineno} in {stack[-1].name}" if stack else ""
        self.regions.append(_Region(
            index=len(self.regions),
            reason=str(getattr(reason, "reason", "")).strip(),
            graph_break=bool(getattr(reason, "graph_break", False)),
            where=where if getattr(reason, "graph_break", False) else "",
            parameter_inputs={i for i, x in enumerate(example_inputs) if isinstance(x, torch.nn.Parameter)},
            dynamo_ops=sum(n.op == "call_function" for n in gm.graph.nodes),
        ))

    def after_forward(self, run: Run) -> None:
        for node in run.nodes:
            if run.ops[node] == COMPILED_OP:
                index = getattr(getattr(node._forward_cls, "compiled_fw", None), "region", None)
                if index is not None:
                    self.region_of[run.ids[node]] = index

    def after_backward(self, run: Run) -> None:
        self.compiled_during_step = len(self.regions) - self.compiled_regions

    def annotate(self, node_id: str, record: dict) -> None:
        index = self.region_of.get(node_id)
        if index is None:
            return
        region = self.regions[index]
        record["compiled"] = opened(region, record.get("saved") or [])

    def finish(self, run: Run, graph: nx.DiGraph) -> None:
        """The JSON's `compile`: the regions the compile step made (a recompile during the measured step, which
        another thread's dispatch mode can cause by flipping dynamo's process-wide guard flag, adds equal copies:
        counted apart, and each node's region renumbered in the order the regions ran)."""
        regions = []
        flops = run.instrument("flops")
        for number, node_id in enumerate(sorted(self.region_of, key=self.region_of.get)):
            opened_region = graph.nodes[node_id]["compiled"]
            opened_region["region"] = number
            opened_region["by_module"] = _by_module(self.regions[self.region_of[node_id]], graph.nodes[node_id],
                                                    getattr(flops, "by_node_module", {}).get(node_id, {}))
            regions.append({"node": node_id, **{k: v for k, v in opened_region.items() if k not in ("nodes", "edges")}})
        compiled = self.regions[:self.compiled_regions]
        breaks = [{"reason": r.reason.splitlines()[0] if r.reason else "", "where": r.where, "explanation": r.reason}
                  for r in compiled if r.graph_break]
        compiled_saved = sum(graph.nodes[n]["saved_bytes"] for n in self.region_of)
        note = NO_CODEGEN
        if self.compiled_during_step:
            note += ("; dynamo compiled again during the measured step (a dispatch mode of another capture in this "
                     "process failed its guards), so the forward's time includes compiling")
        self.summary = {
            "partitioner": PARTITIONER,
            "code_generated": False,
            "note": note,
            "compile_s": self.compile_s,
            "graphs": len(compiled),
            "graph_breaks": len(breaks),
            "break_reasons": breaks,
            "compiled_nodes": len(self.region_of),
            "compiled_saved_bytes": compiled_saved,
            "saved_bytes": sum(data["saved_bytes"] for _, data in graph.nodes(data=True)),
            "eager_saved_bytes": self.eager_saved_bytes,
            "recompiled_during_step": self.compiled_during_step,
            "regions": regions,
        }

    def release(self) -> None:
        self.regions = []
        self.region_of = {}


class _ModuleNaming(torch.fx.Interpreter):
    """Runs a partitioned FX graph node by node (the aten calls its generated code makes, in the same order, each
    value dropped after its last use as there), with the module that node came from on the run's module stack while
    it runs. Module hooks do not run inside compiled code, so without this every forward FLOP of a compiled step was
    counted under no module ("(loss and glue)"); the FX graph keeps each node's module (`nn_module_stack`, and
    `fwd_nn_module_stack` on backward nodes: the forward node whose gradient they compute)."""

    def __init__(self, graph: torch.fx.GraphModule, instrument: CompiledRegions) -> None:
        super().__init__(graph)
        self.instrument = instrument
        self.module_of = {node: module_of(node) for node in graph.graph.nodes}

    def run(self, *args):
        """The graph's outputs; nothing of this call is kept after it (fx.Interpreter keeps its last environment and
        its argument iterator, which would hold the region's saved tensors and returned gradients alive after the
        node ran and raise the step's measured peak above what running the generated code holds)."""
        try:
            return super().run(*args)
        finally:
            self.env = {}
            self.args_iter = iter(())

    def run_node(self, node: torch.fx.Node):
        run = getattr(self.instrument, "run", None)
        module = self.module_of.get(node)
        if run is None or run.modules is None or run.phase not in ("forward", "backward") or module is None:
            return super().run_node(node)
        stack = run.modules.stack
        stack.append(module)
        try:
            return super().run_node(node)
        finally:
            stack.pop()


_ROOT = re.compile(r"^L(\[[^\]]*\])+\.?")  # dynamo's name for the compiled module itself: L['self'], L['args'][0]
_INDEX = re.compile(r"\[(?:'([^']*)'|(\d+))\]")  # layers[0] / ['name'] -> .0 / .name


def module_of(node: torch.fx.Node) -> str | None:
    """The module path (as `named_modules` spells it, "" for the compiled module itself) of the innermost module whose
    forward made `node`, from the FX node's metadata; None where it has none (placeholders, the output)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    value = list(stack.values())[-1]
    path = value[0] if isinstance(value, tuple) else str(value)
    path = _ROOT.sub("", path)
    return _INDEX.sub(lambda m: "." + (m.group(1) if m.group(1) is not None else m.group(2)), path).strip(".")


def _by_module(region: _Region, node: dict, flops_by_module: dict[str, int]) -> list[dict]:
    """A compiled node's saved bytes and backward FLOPs split by the module each came from, in the order the forward
    ran the modules: a saved tensor goes to the module whose forward op made it (storages counted once, parameters
    apart, as the node's own total), a backward op's FLOPs to the module of the forward op it differentiates. What no
    module made (the loss's glue, a difference between the FX graph's saved set and what the hooks saw at run time)
    stays with the node's own module."""
    order = [n["module"] for n in (*(region.forward or {}).get("nodes", []), *(region.backward or {}).get("nodes", []))]
    saved = dict(_saved_by_module((region.backward or {}).get("nodes", [])))
    modules = [m for m in dict.fromkeys(order) if m is not None and (saved.get(m) or flops_by_module.get(m))]
    rows = {m: {"module": m, "saved_bytes": saved.get(m, 0), "flops": flops_by_module.get(m, 0)} for m in modules}
    own = rows.setdefault(node["module"], {"module": node["module"], "saved_bytes": 0, "flops": 0})
    own["saved_bytes"] += node["saved_bytes"] - sum(r["saved_bytes"] for r in rows.values())
    own["flops"] += node["flops"] - sum(r["flops"] for r in rows.values())
    return [r for r in rows.values() if r["saved_bytes"] or r["flops"]]


def _saved_by_module(nodes: list[dict]) -> dict[str | None, int]:
    """The backward graph's saved tensors' bytes by the module that made each (storages once, parameters apart)."""
    by_module: dict[str | None, int] = {}
    seen: set = set()
    for tensor in nodes:
        if tensor["role"] != "saved" or tensor["shape"] is None or tensor["parameter"]:
            continue
        key = tensor["storage"] if tensor["storage"] is not None else ("node", tensor["name"])
        if key in seen:
            continue
        seen.add(key)
        by_module[tensor["module"]] = by_module.get(tensor["module"], 0) + tensor["storage_bytes"]
    return by_module


def _tensor_facts(value) -> dict:
    """Shape, dtype, the tensor's own bytes and its storage's (a view of a wider result keeps all of it alive)."""
    if not isinstance(value, torch.Tensor):
        return {"shape": None, "dtype": None, "bytes": 0, "storage_bytes": 0}
    try:
        storage_bytes = value.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        storage_bytes = value.numel() * value.element_size()
    return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
            "bytes": value.numel() * value.element_size(), "storage_bytes": storage_bytes}


def _aten_name(target) -> str:
    """`aten.mm.default` -> `mm`; other targets as Python names them (`getitem`)."""
    name = str(getattr(target, "__name__", target))
    parts = str(target).split(".")
    return parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims") else name.split(".")[0]


def fx_category(op_name: str) -> str:
    """An aten op's category, asked as autograd's node of the same op would be (`mm` -> `Mm` -> matmul); an add is
    `elementwise` here: no module says whether it joins the residual stream."""
    stem = "".join(part.capitalize() for part in op_name.removesuffix("_backward").split("_"))
    category = category_of(stem + "Backward0")
    return "elementwise" if category == "residual_add" else category


def fx_graph(graph: torch.fx.GraphModule, parameter_inputs: set[int], forward_names: set[str] | None = None) -> dict:
    """An FX graph as plain data: every node (name, kind, op, shape, dtype, bytes, inputs, role) in graph order.

    For a backward graph (`forward_names` given) each node's role is `saved` (a placeholder the forward saved),
    `tangent` (the gradient coming in), `recomputed` (a forward op computed again here: the same joint-graph node
    appears in the forward graph, which computed it too), `gradient` (everything else) or `output`."""
    nodes = []
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        facts = _tensor_facts(value)
        op = _aten_name(node.target) if node.op == "call_function" else node.op
        if forward_names is None:
            role = "forward"
        elif node.op == "placeholder":
            role = "tangent" if node.name.startswith("tangents_") else "saved"
        elif node.op == "output":
            role = "output"
        else:
            role = "recomputed" if node.name in forward_names else "gradient"
        primal = node.name.startswith("primals_") and node.name.removeprefix("primals_").isdigit()
        nodes.append({"name": node.name, "kind": node.op, "op": op, "target": str(node.target), **facts,
                      "inputs": [a.name for a in node.all_input_nodes], "role": role,
                      "parameter": primal and int(node.name.removeprefix("primals_")) - 1 in parameter_inputs,
                      "storage": _storage_id(value), "module": module_of(node)})
    output = graph.graph.output_node() if hasattr(graph.graph, "output_node") else list(graph.graph.nodes)[-1]
    return {"nodes": nodes, "output_names": [a.name for a in output.all_input_nodes]}


def _storage_id(value) -> int | None:
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def opened(region: _Region, saved_at_run: list[dict]) -> dict:
    """What a CompiledFunctionBackward node shows when opened: its region, its backward FX graph as nodes and edges,
    the tensors saved between its forward and backward (with bytes; storages counted once, parameters apart) and
    the forward ops its backward recomputes."""
    backward = region.backward or {"nodes": [], "output_names": []}
    nodes = backward["nodes"]
    saved = [n for n in nodes if n["role"] == "saved" and n["shape"] is not None]
    seen: set = set()
    saved_bytes = 0
    for tensor in saved:
        key = tensor["storage"] if tensor["storage"] is not None else ("node", tensor["name"])
        if tensor["parameter"] or key in seen:
            continue
        seen.add(key)
        saved_bytes += tensor["storage_bytes"]
    recomputed = [n for n in nodes if n["role"] == "recomputed"]
    for n in nodes:
        n["category"] = fx_category(n["op"]) if n["kind"] == "call_function" else "other"
    return {
        "region": region.index,
        "graph_break_after": region.reason.splitlines()[0] if region.graph_break and region.reason else "",
        "graph_break_where": region.where,
        "dynamo_ops": region.dynamo_ops,
        "forward_nodes": len((region.forward or {}).get("nodes", [])),
        "backward_nodes": len(nodes),
        "saved": [{k: t[k] for k in ("name", "shape", "dtype", "bytes", "storage_bytes", "parameter")} for t in saved],
        "saved_bytes": saved_bytes,
        "saved_at_run": len(saved_at_run),
        "recomputed": [{"name": n["name"], "op": n["op"], "shape": n["shape"]} for n in recomputed],
        "nodes": [{k: v for k, v in n.items() if k != "storage"} for n in nodes],
        "edges": [[source, n["name"]] for n in nodes for source in n["inputs"]],
    }
