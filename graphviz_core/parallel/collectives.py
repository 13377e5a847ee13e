"""Records the collectives one rank issues (all-gather, reduce-scatter, all-reduce, ...) with their sizes and triggers.

An observer of one run: a dispatch mode that sees every c10d / functional-collective op, whether FSDP2 issues it
from a module hook or a DTensor redistribution issues it from inside an autograd node's backward, plus a
`ModTracker` for the module that was running. Per-rank traffic uses the ring-algorithm volumes NCCL's own
performance notes use ("bus bandwidth", nccl-tests PERFORMANCE.md): an all-gather or reduce-scatter of a buffer
of B bytes over n ranks moves (n-1)/n * B per rank, an all-reduce 2 (n-1)/n * B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._autograd import _get_sequence_nr
from torch._guards import active_fake_mode
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from graphviz_core.graph.categories import category_of, normalise_op
from graphviz_core.parallel.settings import GPUS_PER_NODE, INFINIBAND_BYTES_PER_S, NVLINK_BYTES_PER_S
from graphviz_core.parallel.world import running_of

# The interconnect the times are quoted at (per direction, per GPU): graphviz_core.parallel.settings.
LINKS = {"NVLink": NVLINK_BYTES_PER_S, "InfiniBand": INFINIBAND_BYTES_PER_S}

_c10d = torch.ops.c10d
_funcol = torch.ops._c10d_functional
# op packet -> (kind, index of the process group / group name argument)
_C10D = {
    _c10d._allgather_base_: ("all_gather", 2),
    _c10d.allgather_: ("all_gather", 2),
    _c10d.allgather_into_tensor_coalesced_: ("all_gather", 2),
    _c10d._reduce_scatter_base_: ("reduce_scatter", 2),
    _c10d.reduce_scatter_: ("reduce_scatter", 2),
    _c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", 2),
    _c10d.allreduce_: ("all_reduce", 1),
    _c10d.allreduce_coalesced_: ("all_reduce", 1),
    _c10d.broadcast_: ("broadcast", 1),
    _c10d.alltoall_base_: ("all_to_all", 2),
    # Pipeline parallelism's point-to-point transfers (send(tensors, group, dst, tag), recv_(tensors, group, src, tag)).
    _c10d.send: ("send", 1),
    _c10d.recv_: ("recv", 1),
}
_FUNCTIONAL = {
    _funcol.all_gather_into_tensor: ("all_gather", 2),
    _funcol.reduce_scatter_tensor: ("reduce_scatter", 3),
    _funcol.all_reduce: ("all_reduce", 2),
    _funcol.all_to_all_single: ("all_to_all", 3),
    _funcol.broadcast: ("broadcast", 2),
}
# Volume each rank sends, as a multiple of (n-1)/n times the full buffer (broadcast: the root sends B once).
_RING_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "all_to_all": 1}


@dataclass(frozen=True)
class Collective:
    """One collective as rank 0 issued it."""

    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | broadcast | send | recv
    phase: str  # forward | backward | optimizer
    module: str  # the module that triggered it: FSDP's hook owner, else the innermost module running ("" = top level)
    parameters_of: str | None  # FSDP: the module whose parameters it gathers or whose gradients it reduces
    autograd_node: str  # the backward node that issued it (a DTensor redistribution), "" when a hook did (FSDP)
    group: str  # the mesh dimension it ran over (e.g. "dp", "tp")
    group_size: int
    buffer_bytes: int  # the whole gathered / reduced buffer
    traffic_bytes: int  # what this rank sends over the link, ring algorithm
    link: str  # NVLink inside a node of GPUS_PER_NODE ranks, InfiniBand across nodes
    time_s: float  # traffic_bytes at the link's bandwidth, no latency term
    ranks: tuple[int, ...] = ()  # the group's global ranks (send / recv: this rank and its peer)

    @property
    def issued_by(self) -> str:
        """`autograd node` when the collective is a node of the backward graph, `hook` when FSDP's hooks ran it."""
        return "autograd node" if self.autograd_node else ("hook" if self.parameters_of is not None else "op")


def ring_traffic_bytes(kind: str, buffer_bytes: int, group_size: int) -> int:
    """Bytes one rank sends for a collective over `group_size` ranks (nccl-tests' bus-bandwidth volumes)."""
    if group_size <= 1:
        return 0
    if kind in ("broadcast", "send"):
        return buffer_bytes
    if kind == "recv":
        return 0  # received, not sent
    return _RING_FACTOR[kind] * buffer_bytes * (group_size - 1) // group_size


def link_of(ranks: list[int], gpus_per_node: int = GPUS_PER_NODE) -> str:
    """NVLink when every rank of the group sits on one node, InfiniBand otherwise."""
    return "NVLink" if len({r // gpus_per_node for r in ranks}) == 1 else "InfiniBand"


def _nbytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _process_group(arg: object) -> dist.ProcessGroup:
    if isinstance(arg, str):
        return dist.distributed_c10d._resolve_process_group(arg)
    if isinstance(arg, dist.ProcessGroup):
        return arg
    return dist.ProcessGroup.unbox(arg)


class CollectiveRecorder(TorchDispatchMode):
    """Dispatch mode that appends a `Collective` for every collective op this rank issues.

    `group_names` maps a process group's name to the mesh dimension it belongs to. Set `phase` from the driving
    code ("forward", "backward", "optimizer").
    """

    def __init__(self, group_names: dict[str, str]) -> None:
        super().__init__()
        self.group_names = group_names
        self.phase = "forward"
        self.collectives: list[Collective] = []
        self.modules = ModTracker()
        self._fake_mode_on_entry = None
        self._fsdp_hooks: list[str] = []  # FSDP param groups whose hook is running (innermost last)
        self._fsdp_targets: list[str] = []  # FSDP param groups being gathered / reduced
        self._patched: dict = {}
        # id of the autograd node converting a block's input -> (its type, that block's path). By id, not the node:
        # a checkpointed block's recomputed input conversion never runs in backward, and holding it kept its whole
        # recomputed graph alive into the optimizer step (llama-tiny TP 2, full checkpointing: 91,136 bytes a layer).
        self._conversion_owner: dict[int, tuple[str, str]] = {}
        self._hooks: list = []
        # Autograd node sequence number -> the innermost module running when the forward made it. A collective issued
        # inside a node's backward (context parallel's ring, in the attention node) is the module's that made that
        # node: in backward ModTracker's set of active modules blurs between layers (it kept the last layer's
        # attention, so every layer's ring traffic read `layers.2`).
        self._made_in: dict[int, str] = {}

    def __enter__(self) -> CollectiveRecorder:
        self._fake_mode_on_entry = active_fake_mode()
        self.modules.__enter__()
        self._patch_fsdp()
        return super().__enter__()

    def __exit__(self, *args) -> None:
        super().__exit__(*args)
        self._unpatch_fsdp()
        self.modules.__exit__(*args)
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._conversion_owner.clear()
        self._made_in.clear()

    def name_input_conversions(self, block: torch.nn.Module, path: str) -> None:
        """Remember which block each input-conversion node belongs to. Tensor parallelism converts a block's input
        in a forward pre-hook; ours runs after it, sees the converted DTensor and its grad_fn, whose backward
        later issues the all-reduce. (ModTracker's set of active modules blurs between layers in backward.)"""

        def hook(module, args, kwargs):
            for t in (*args, *kwargs.values()):
                if isinstance(t, DTensor) and t.grad_fn is not None:
                    self._conversion_owner[id(t.grad_fn)] = (type(t.grad_fn).__name__, path)

        self._hooks.append(block.register_forward_pre_hook(hook, with_kwargs=True))

    def _patch_fsdp(self) -> None:
        """FSDP2 issues its collectives from its param groups' hooks; wrap them (as torch's FSDPMemTracker wraps
        them per instance) to know whose hook ran and whose parameters moved. Restored on exit; callers hold the
        simulation lock, so no other run sees the wrappers."""
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        def wrap(name: str, stack: list[str]):
            original = getattr(FSDPParamGroup, name)

            def wrapper(group, *args, **kwargs):
                stack.append(group._module_fqn or "")
                try:
                    return original(group, *args, **kwargs)
                finally:
                    stack.pop()

            self._patched[name] = original
            setattr(FSDPParamGroup, name, wrapper)

        for name in ("pre_forward", "pre_backward", "post_backward"):
            wrap(name, self._fsdp_hooks)
        wrap("unshard", self._fsdp_targets)

    def _unpatch_fsdp(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        for name, original in self._patched.items():
            setattr(FSDPParamGroup, name, original)
        self._patched.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor lower to local ops; their collectives come back through here
        out = func(*args, **(kwargs or {}))
        # DTensor's sharding propagation runs ops under a nested fake mode; those are not this rank's work.
        if active_fake_mode() is self._fake_mode_on_entry:
            if self.phase == "forward":
                # autograd made this op's node (if any) before dispatching to here: the last number handed out
                self._made_in.setdefault(_get_sequence_nr() - 1, self._innermost())
            packet = func.overloadpacket
            if packet in _C10D:
                kind, group_arg = _C10D[packet]
                self._record(kind, args, group_arg, functional=False)
            elif packet in _FUNCTIONAL:
                kind, group_arg = _FUNCTIONAL[packet]
                self._record(kind, args, group_arg, functional=True)
        return out

    def _innermost(self) -> str:
        """The innermost module running, by its path from the model ("" = top level)."""
        parents = [p for p in self.modules.parents if p != "Global"]
        # ModTracker names modules by dotted path from the root class; of the innermost ones it holds, the one running
        # (world.running_of; the tracker names the model's modules in its pre-order)
        leaves = [p for p in parents if not any(q.startswith(p + ".") for q in parents)]
        if not leaves:
            return ""
        order = {name: i for i, name in enumerate(self.modules._known_modules.values())}
        return running_of(leaves, self.phase, lambda p: order.get(p, -1)).partition(".")[2]

    def _record(self, kind: str, args: tuple, group_arg: int, functional: bool) -> None:
        group = _process_group(args[group_arg])
        size = group.size()
        if functional:
            # all_gather_into_tensor(input, group_size, name): the buffer is n local inputs; the others take it whole.
            buffer = _nbytes(args[0]) * (size if kind == "all_gather" else 1)
        elif kind == "all_gather":
            buffer = _nbytes(args[0])  # (output, input, group): the gathered output
        elif kind == "reduce_scatter":
            buffer = _nbytes(args[1])  # (output, input, group): the full input being reduced
        else:
            buffer = _nbytes(args[0])
        ranks = dist.get_process_group_ranks(group)
        if kind in ("send", "recv"):  # two ranks: this one and its peer (the op names it by group rank)
            ranks, size = [dist.get_rank(), dist.get_global_rank(group, args[2])], 2
        link = link_of(ranks)
        traffic = ring_traffic_bytes(kind, buffer, size)
        if kind == "all_to_all" and functional and args[2]:
            # Uneven splits (torch's permute_tensor, the ring attention's rotation, sends its whole buffer to one
            # peer): the rows this rank sends to the others, from its own input split sizes.
            me = dist.get_rank(group)
            rows = sum(args[2])
            traffic = buffer * sum(n for peer, n in enumerate(args[2]) if peer != me) // max(rows, 1)
        node = torch._C._current_autograd_node()
        node_name = normalise_op(node.name()) if node is not None else ""
        if category_of(node_name) != "communication":
            node_name = ""  # the node merely hosted a hook (FSDP's); the collective is not part of the graph
        if self._fsdp_hooks:
            module = self._fsdp_hooks[-1]
            # unshard() gathers a group's parameters (its own or, prefetching, the next one's); post_backward
            # reduces the hook owner's gradients.
            parameters_of = self._fsdp_targets[-1] if self._fsdp_targets else module
        elif node is not None and self._conversion_owner.get(id(node), ("",))[0] == type(node).__name__:
            module, parameters_of = self._conversion_owner[id(node)][1], None
        elif self.phase != "forward" and node is not None and node._sequence_nr() in self._made_in:
            module, parameters_of = self._made_in[node._sequence_nr()], None
        else:
            module, parameters_of = self._innermost(), None
        self.collectives.append(
            Collective(
                kind=kind,
                phase=self.phase,
                module=module,
                parameters_of=parameters_of,
                autograd_node=node_name,
                group=self.group_names.get(group.group_name, group.group_name),
                group_size=size,
                buffer_bytes=buffer,
                traffic_bytes=traffic,
                link=link,
                time_s=traffic / LINKS[link],
                ranks=tuple(ranks),
            )
        )
