"""The interface every instrument of a capture implements, and the run they all observe.

An instrument is one small observer of one forward + backward, as PyTorch's own `torch.distributed._tools` trackers
are: module attribution, saved tensors, FLOPs, node timing, gradient norms and the memory timeline are each one
class (graphviz_core.capture.instruments). The engine (graphviz_core.capture.engine) calls, in this order:

    start(run)                       the model is built and the batch made; nothing has run
    forward_contexts(run)            context managers entered around the forward (saved-tensor hooks)
    module_pre / module_post         around every module call, forward and checkpoint recompute
    on_op(func, args, kwargs, out)   after every aten op of the model (one dispatch mode for all)
    after_forward(run)               the graph is walked: run.nodes, run.ids, run.ops are set
    node_pre / node_post             around every autograd node's backward
    after_backward(run)              the backward has finished
    annotate(node_id, record)        fill this instrument's per-node attributes (graph/schema.py's NodeRecord)
    finish(run, graph)               the annotated graph exists; summaries may read it
    release()                        drop every reference to tensors, modules and nodes

Only what an instrument overrides is installed: a capture without FLOPs or the timeline runs no dispatch mode, one
without timing, norms or FLOPs registers no node hooks. A new instrument is a new class, not a new branch.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import networkx as nx
    import torch

    from graphviz_core.capture.instruments.modules import ModuleTracker
    from graphviz_core.config import ModelConfig


class Run:
    """What every instrument may read about the capture in progress (set by the engine, phase by phase)."""

    def __init__(self, config: ModelConfig, device: str, check: Callable[[], None]) -> None:
        self.config = config
        self.device = device
        self.real = device != "meta"
        self.check = check  # raises CaptureCancelled; called at module and node boundaries
        self.phase = "setup"  # "forward", "walk", "backward", "done"
        self.model: torch.nn.Module | None = None
        self.held: tuple = ()  # the batch (or a user's inputs): alive through the step, not the model's
        self.scaler: torch.amp.GradScaler | None = None  # float16 autocast: scales the loss, then steps the optimizer
        self.param_storages: set[int] = set()  # storage keys of the parameters
        self.modules: ModuleTracker | None = None  # always present: the module stack every instrument may read
        self.current: str | None = None  # the node whose backward is running (None between nodes)
        self.last_finished: str | None = None  # the node whose post hooks ran last
        # After the walk: the nodes reachable from the loss (pre-order), their normalised op names and ids.
        self.nodes: list = []
        self.ops: dict = {}
        self.ids: dict = {}
        self.instruments: dict[str, Instrument] = {}

    def instrument(self, name: str) -> Instrument | None:
        return self.instruments.get(name)

    def release(self) -> None:
        """Drop every reference to autograd nodes, modules and tensors, each instrument's first: instruments and the
        run point at each other, so without this the model and its gradients would live until a cyclic GC pass."""
        for instrument in self.instruments.values():
            if getattr(instrument, "run", None) is not None:  # started: building the model may refuse before that
                instrument.release()
        self.instruments = {}
        self.modules = None
        self.model = None
        self.held = ()
        self.nodes, self.ops, self.ids = [], {}, {}


class Instrument:
    """One observer of a capture. Override only the hooks the instrument needs (see the module docstring)."""

    name = ""
    needs: tuple[str, ...] = ()  # other instruments whose results this one reads (added automatically)

    def start(self, run: Run) -> None:
        self.run = run

    def forward_contexts(self, run: Run) -> list[AbstractContextManager]:
        return []

    def module_pre(self, module: torch.nn.Module, path: str, args: tuple, kwargs: dict) -> None: ...

    def module_post(self, module: torch.nn.Module, path: str) -> None: ...

    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None: ...

    def after_forward(self, run: Run) -> None: ...

    def node_pre(self, node_id: str) -> None: ...

    def node_post(self, node_id: str, is_leaf: bool, grad_inputs: tuple, grad_outputs: tuple) -> None: ...

    def after_backward(self, run: Run) -> None: ...

    def annotate(self, node_id: str, record: dict) -> None: ...

    def finish(self, run: Run, graph: nx.DiGraph) -> None: ...

    def release(self) -> None: ...


def overrides(instrument: Instrument, hook: str) -> bool:
    """Whether `instrument` implements `hook` (the engine installs only the hooks some instrument needs)."""
    return getattr(type(instrument), hook) is not getattr(Instrument, hook)
