"""FLOPs: every aten op's count (graphviz_core.capture.flop_formulas) charged to where the run is: the forward (by
module and op), the node whose backward runs, checkpointing's recompute inside it, or the gradient sums the engine
runs between nodes; and the bytes of gradient each node reads and writes (the roofline's traffic)."""

from __future__ import annotations

from collections import Counter

import networkx as nx

from graphviz_core.capture.flop_formulas import op_info
from graphviz_core.capture.instrument import Instrument, Run
from graphviz_core.capture.result import FlopSummary


class FlopCounter(Instrument):
    name = "flops"
    needs = ("order",)  # gradient sums are placed by the order the engine ran the nodes

    def start(self, run: Run) -> None:
        super().start(run)
        self.forward = 0
        self.by_node: Counter[str] = Counter()
        self.recompute_by_node: Counter[str] = Counter()
        # node id -> module -> FLOPs, where a node's backward names its modules: only a compiled region's does (its FX
        # graph runs node by node with each node's module on the stack; graphviz_core.capture.compiled)
        self.by_node_module: dict[str, Counter[str]] = {}
        self.unattributed = 0
        self.forward_by_module_op: Counter[tuple[str, str]] = Counter()  # (innermost module, aten op)
        self.by_op: dict[str, Counter[str]] = {"forward": Counter(), "backward": Counter()}
        self.io_bytes: dict[str, int] = {}  # node id -> bytes of the gradients it read and wrote
        self.sums_after: Counter[str] = Counter()  # producer node id -> FLOPs of the sums that followed it
        self.summary = FlopSummary(0, 0, {}, 0, 0)

    def on_op(self, func, args, kwargs, out) -> None:
        formula, name = op_info(func)
        if formula is not None:
            flops = int(formula(*args, out_val=out, **kwargs))
            if flops:
                self.charge(flops, name)

    def charge(self, flops: int, op: str) -> None:
        """Count `flops` of aten op `op` (its packet's name) where the run is now."""
        run = self.run
        phase = run.phase
        if phase in self.by_op:
            self.by_op[phase][op] += flops
        if phase == "forward":
            self.forward += flops
            stack = run.modules.stack  # the modules whose forward is running, innermost last
            self.forward_by_module_op[stack[-1] if stack else "", op] += flops
        elif run.current is None:
            self.unattributed += flops
            if run.last_finished is not None:
                self.sums_after[run.last_finished] += flops
        else:
            self.by_node[run.current] += flops
            if run.modules.stack:
                self.by_node_module.setdefault(run.current, Counter())[run.modules.stack[-1]] += flops
            if run.modules.recompute_depth:  # > 0 while checkpointing re-runs a forward inside backward
                self.recompute_by_node[run.current] += flops

    def node_post(self, node_id: str, is_leaf: bool, grad_inputs: tuple, grad_outputs: tuple) -> None:
        self.io_bytes[node_id] = sum(g.nbytes for g in (*grad_inputs, *grad_outputs) if g is not None)

    def annotate(self, node_id: str, record: dict) -> None:
        record["flops"] = self.by_node[node_id]
        record["recompute_flops"] = self.recompute_by_node[node_id]
        record["grad_io_bytes"] = self.io_bytes.get(node_id, 0)

    def finish(self, run: Run, graph: nx.DiGraph) -> None:
        self._place_gradient_sums(graph, run.instrument("order").position)
        by_category: Counter[str] = Counter()
        for node_id, data in graph.nodes(data=True):
            by_category[data["category"]] += self.by_node[node_id]
        forward_by_module: Counter[str] = Counter()
        by_module_op: dict[str, dict[str, int]] = {}
        for (module_path, op_name), flops in self.forward_by_module_op.items():
            forward_by_module[module_path] += flops
            by_module_op.setdefault(module_path, {})[op_name] = flops
        self.summary = FlopSummary(
            forward=self.forward,
            backward=sum(self.by_node.values()) + self.unattributed,
            backward_by_category={k: v for k, v in sorted(by_category.items()) if v},
            backward_unattributed=self.unattributed,
            backward_recompute=sum(self.recompute_by_node.values()),
            forward_by_module=dict(sorted(forward_by_module.items())),
            forward_by_op=dict(sorted(self.by_op["forward"].items())),
            backward_by_op=dict(sorted(self.by_op["backward"].items())),
            forward_by_module_op={m: dict(sorted(ops.items())) for m, ops in sorted(by_module_op.items())},
        )

    def _place_gradient_sums(self, graph: nx.DiGraph, position: dict[str, int]) -> None:
        """Charge each sum the engine ran between nodes to the node whose input it summed (`gradient_sum_flops`).

        The engine adds a gradient into a node's input buffer right after the producer's hooks ran, when that
        buffer already holds a gradient from another producer; so the receiver is the producer's successor
        with another producer that finished earlier.
        """
        for producer, flops in self.sums_after.items():
            if producer not in graph:
                continue
            mine = position[producer]
            receivers = [
                v for v in graph.successors(producer)
                if any(u != producer and position.get(u, mine) < mine for u in graph.predecessors(v))
            ]
            if receivers:
                graph.nodes[receivers[0]]["gradient_sum_flops"] += flops
