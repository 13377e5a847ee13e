"""Module attribution: which `nn.Module`'s forward created each autograd node, and which module is running now."""

from __future__ import annotations

from graphviz_core.capture.instrument import Instrument, Run
from graphviz_core.capture.walk import next_sequence_nr
from graphviz_core.models.checkpoint_policies import RECOMPUTED


class ModuleTracker(Instrument):
    """Always present: the stack of running modules (other instruments name steps and FLOPs by it), checkpointing's
    recompute depth, and each node's innermost module.

    Autograd numbers the nodes a thread creates in order (`_sequence_nr`); each module call in the forward records
    the range of numbers given out between its pre and post hooks. Ranges nest as the calls do, so painting them
    outermost first leaves each number with its innermost module."""

    name = "modules"

    def start(self, run: Run) -> None:
        super().start(run)
        model = run.model
        self.paths = {m: name for name, m in model.named_modules()}
        self.types = {path: type(m).__name__ for m, path in self.paths.items()}
        self.stack: list[str] = []  # forward: the modules whose forward is running, innermost last
        self.recompute_depth = 0  # > 0 while checkpointing re-runs a forward inside backward
        self.open_calls: list[int] = []  # forward: the next sequence number when each running module call started
        self.calls: list[tuple[int, int, int, str, bool]] = []  # (depth, first, end, path, checkpointed) per call
        self.labels: dict[object, str] = {}  # autograd node -> module path
        self.recomputed_nodes: set = set()  # made inside a checkpointed module: their saved fields are placeholders

    def enter(self, module, path: str) -> None:
        if self.run.phase == "backward":
            self.recompute_depth += 1
            return
        self.stack.append(path)
        if self.run.phase == "forward":
            self.open_calls.append(next_sequence_nr())

    def leave(self, module, path: str) -> None:
        if self.run.phase == "backward":
            self.recompute_depth -= 1
            return
        if self.stack:
            self.stack.pop()
        if self.run.phase != "forward":
            return
        start = self.open_calls.pop()
        self.calls.append((len(self.open_calls), start, next_sequence_nr(), path, getattr(module, RECOMPUTED, False)))

    def after_forward(self, run: Run) -> None:
        """Each node's module: the innermost module whose forward call was running when autograd created it. Nodes
        made inside a checkpointed module are marked too."""
        if not self.calls:
            return
        base = min(call[1] for call in self.calls)
        size = max(call[2] for call in self.calls) - base
        owner: list[str | None] = [None] * size
        recomputed = bytearray(size)
        for _depth, start, end, path, checkpointed in sorted(self.calls, key=lambda call: call[0]):
            owner[start - base:end - base] = [path] * (end - start)
            if checkpointed:
                recomputed[start - base:end - base] = b"\x01" * (end - start)
        for node in run.nodes:
            index = node._sequence_nr() - base
            if 0 <= index < size and owner[index] is not None and run.ops[node] != "AccumulateGrad":
                self.labels[node] = owner[index]
                if recomputed[index]:
                    self.recomputed_nodes.add(node)

    def module_type(self, node) -> str:
        """The type name of the node's module ("" where no module created it)."""
        path = self.labels.get(node)
        return self.types[path] if path is not None else ""

    def release(self) -> None:
        for store in (self.labels, self.calls, self.recomputed_nodes, self.paths):
            store.clear()
