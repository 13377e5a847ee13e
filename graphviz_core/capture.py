"""Runs one instrumented forward + backward pass and returns the annotated autograd graph as a `Capture`.

This is the only place that calls `.backward()` on a model. Instrumentation, phase by phase:

- forward: module pre/post hooks record the range of autograd sequence numbers each module call gave out,
  which attributes every new autograd node to the innermost module whose forward created it; saved-tensor
  hooks record every tensor saved for backward (in order, with its storage); a dispatch mode counts forward
  FLOPs and feeds the memory timeline.
- graph walk: nodes get deterministic ids (pre-order from the loss); each node's saved tensors are
  found by unpacking its `_saved_*` fields, which calls our unpack hook with the save's id.
- backward: node pre/post hooks time each node (perf counter on CPU, CUDA events on GPU), take the norm
  of the gradient flowing out of it and mark it as the node that the dispatch mode charges FLOPs to.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import math
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from graphviz_core.admission import Ticket, admit
from graphviz_core.categories import category_in_module, normalise_op
from graphviz_core.config import CUSTOM, MODEL_DEFAULTS, ModelConfig
from graphviz_core.device import device_guard, resolve_device, synchronize
from graphviz_core.flops import op_info
from graphviz_core.models import RECOMPUTED, build_model, compute_loss, make_batch
from graphviz_core.timeline import MemoryTimeline, StorageObserver, tensors_in

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Source:
    """A model to capture that is not built from a config: the module, its example inputs, and the loss."""

    model: torch.nn.Module
    inputs: tuple
    loss_fn: Callable[..., torch.Tensor]  # loss_fn(model_output) -> scalar tensor


@dataclass(frozen=True)
class SaveEvent:
    """One tensor saved for backward, in the forward order it was saved."""

    order: int
    node: str  # id of the node whose backward needs it
    shape: tuple[int, ...]
    dtype: str
    storage_bytes: int
    counted: bool  # False when the storage is a parameter's or was already counted for an earlier save


@dataclass(frozen=True)
class GraphSummary:
    nodes: int
    edges: int
    by_category: dict[str, int]
    by_op: dict[str, int]
    parameters: int  # AccumulateGrad nodes = parameter tensors reached by backward
    parameter_count: int  # scalars in those tensors


@dataclass(frozen=True)
class MemorySummary:
    saved_bytes: int  # tensors saved for backward, storages de-duplicated, parameters excluded
    parameter_bytes: int
    gradient_bytes: int  # .grad of every parameter reached
    peak_bytes: int  # CUDA max_memory_allocated over forward + backward; elsewhere the timeline's peak
    baseline_bytes: int | None  # allocated before the forward (parameters, inputs); CUDA only
    checkpoint_held_bytes: int  # inputs that checkpointed regions keep for recomputation (not saved tensors)
    saved_bytes_by_category: dict[str, int]


@dataclass(frozen=True)
class FlopSummary:
    forward: int
    backward: int  # every aten op that ran during backward, including the two items below
    backward_by_category: dict[str, int]
    backward_unattributed: int  # ran between nodes: the engine summing gradients where paths meet
    backward_recompute: int  # forward ops re-run by checkpointing inside backward
    # Where the work went, for flop_analysis: forward FLOPs by innermost module, and both passes by aten op.
    forward_by_module: dict[str, int] = field(default_factory=dict)
    forward_by_op: dict[str, int] = field(default_factory=dict)
    forward_by_module_op: dict[str, dict[str, int]] = field(default_factory=dict)  # module -> aten op -> FLOPs
    backward_by_op: dict[str, int] = field(default_factory=dict)


# Below this share of the wall time on the CPU, the capturing thread spent the rest waiting: for the interpreter lock
# (another session's Python on a shared server) or for a core (other processes). Undisturbed runs here read 0.9-1.0.
DISTURBED_BELOW = 0.7


@dataclass(frozen=True)
class TimeSummary:
    forward_s: float | None  # wall time with instrumentation; None on meta
    backward_s: float | None
    # CPU time of the capturing thread over the same spans (CPU device only; None elsewhere): how much of the wall
    # time it was running at all. Intra-op worker threads are not counted, but the capturing thread works beside them.
    forward_cpu_s: float | None = None
    backward_cpu_s: float | None = None

    @property
    def cpu_share(self) -> float | None:
        """Thread CPU time / wall time over forward + backward; None where not measured."""
        if self.forward_cpu_s is None or self.backward_cpu_s is None or not self.forward_s or not self.backward_s:
            return None
        return (self.forward_cpu_s + self.backward_cpu_s) / (self.forward_s + self.backward_s)

    @property
    def disturbed(self) -> bool:
        """True when the times mostly measure waiting, not this config: see DISTURBED_BELOW."""
        share = self.cpu_share
        return share is not None and share < DISTURBED_BELOW

    def note(self) -> str | None:
        """One sentence for a disturbed measurement, None otherwise."""
        if not self.disturbed:
            return None
        return (f"Timing disturbed: the capturing thread ran for only {self.cpu_share:.0%} of the forward + backward "
                f"wall time, waiting the rest for a CPU core or for other Python on this server, so these times mostly "
                f"measure the wait (FLOPs, bytes and the graph are unaffected; run it again on a quieter server).")


@dataclass(frozen=True)
class Capture:
    """One captured backward pass: the graph (DESIGN.md's schema) plus summaries."""

    config: ModelConfig
    device: str
    graph: nx.DiGraph
    summary: GraphSummary
    memory: MemorySummary
    flops: FlopSummary
    time: TimeSummary
    loss: float | None
    save_order: tuple[SaveEvent, ...] = field(repr=False)
    backward_order: tuple[str, ...] = field(repr=False)
    timeline: MemoryTimeline | None = field(default=None, repr=False)  # graphviz_core.timeline


def capture_backward(
    config: ModelConfig, progress: Progress | None = None, ticket: Ticket | None = None, source: Source | None = None
) -> Capture:
    """Build the model, run forward + backward once with instrumentation, and return the Capture.

    `source` replaces the model, batch and loss that `config` would build (graphviz_core.user_model passes a
    user's own module this way). Raises ValueError (CaptureError) with an actionable sentence for configs that
    cannot run here, and CaptureCancelled when `ticket` is cancelled (checked while queued and at every module
    and node).
    """
    if source is None and config.model == CUSTOM:  # a trusted-folder model picked in the web app
        from graphviz_core.user_model import trusted_capture

        return trusted_capture(config, progress, ticket)
    say = progress or (lambda phase: None)
    device = resolve_device(config.device)
    if device != "meta":
        warm_up(device)
        if source is None:
            _warm_family(config, device)
    # On meta, mirror the attention kernels of the device `auto` would pick (GRAPHVIZ_CORE_DEVICE included),
    # and for the backward too: checkpointing recomputes there.
    meta_kernels = contextlib.nullcontext()
    if device == "meta":
        meta_kernels = _fused_attention_on_meta(resolve_device("auto") == "cuda")
        if _META_SDPA_LOCK.locked():  # the page's line said "waiting for its turn", as if queued behind real runs
            say("waiting for the dry run before it (dry runs in one process take turns)")
    with admit(config, device, ticket) as admitted:  # waits its turn; reserves the estimated bytes
        run = _Run(config, device, say, admitted.check, source)
        try:
            with device_guard(device), meta_kernels, no_cyclic_gc():
                return run.capture()
        finally:
            run.release()


@contextlib.contextmanager
def no_cyclic_gc(collect_first: bool = False) -> Iterator[None]:
    """Python's cyclic collector paused while a capture (or a simulated parallel step) runs; `collect_first`
    clears what is already garbage before the pause.

    A capture allocates thousands of small objects (node records, hook closures, the networkx graph); each
    few hundred start a collection that walks every tracked object in the process (400,000 once torch and
    transformers are imported), and cProfile charged 0.44 s of a 1.09 s meta capture of 8 Llama-70B layers to
    networkx's add_node, which only allocates. Nothing a capture makes needs the cyclic collector to be freed
    (tests/test_capture.py checks the model goes by reference counting), so it resumes afterwards as it was.
    """
    was_enabled = gc.isenabled()
    if collect_first:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_WARM_LOCK = threading.RLock()  # re-entered: the warm-up capture calls warm_up itself
_WARMED: dict[str, float] = {}
_WARM_FAMILIES: set[tuple] = set()  # (device, model, attention, dtype, checkpoint) warmed by a tiny twin


def warm_up(device: str = "cpu", before: Callable[[], object] | None = None) -> float:
    """Pay this process's one-time costs on `device` once, outside any timed region; the seconds it took.

    The first forward and backward in a process start the intra-op thread pool, create the CPU kernels'
    primitives and fill the dispatcher's first-call caches (gpt2-tiny's first capture read forward 1.25 s
    against 60 ms on a rerun). A one-layer GPT-2 at width 32, captured once per device, pays them here so the
    first measurement a user sees is the model's. Thread-safe; later calls return 0.0 at once. The server
    starts it in the background when it starts (app.py, graphviz_core.ui.serve); `before` runs first under the
    same lock, so a capture that starts meanwhile waits instead of being timed beside it.
    """
    with _WARM_LOCK:
        if before is not None:  # work that must not share the CPU with a timed capture (the server's imports)
            before()
        if device in _WARMED:
            return 0.0
        _WARMED[device] = 0.0  # before the capture below, which would otherwise warm itself
        started = time.perf_counter()
        tiny = ModelConfig(model="gpt2", hidden=32, layers=1, heads=2, vocab=64, context=16, batch=1, seq=8, device=device)
        _WARM_FAMILIES.add((device, tiny.model, tiny.attention, tiny.dtype, tiny.checkpoint))  # it is that kind's twin
        capture_backward(tiny)
        # What is alive now (torch, transformers, the pages: ~400,000 objects) lives as long as the process:
        # freezing it keeps every later collection from walking it again.
        gc.collect()
        gc.freeze()
        _WARMED[device] = time.perf_counter() - started
        return _WARMED[device]


def _warm_family(config: ModelConfig, device: str) -> None:
    """Once per process, family, attention kernel, dtype and checkpointing: a tiny capture of the same kind first.

    Each kind of model meets kernels of its own the first time (convolutions, bfloat16 matmuls, transformers'
    Python): resnet-tiny's first capture in a walkthrough read forward 2.87 s against backward 266 ms for 3.4
    MFLOP, and a compare page then showed that first, inflated time as config A's. The tiny twin pays that.
    """
    key = (device, config.model, config.attention, config.dtype, config.checkpoint)
    with _WARM_LOCK:
        if key in _WARM_FAMILIES or config.model not in MODEL_DEFAULTS:
            return
        _WARM_FAMILIES.add(key)  # before the capture below, which would otherwise warm itself
        try:
            tiny = ModelConfig(**{**MODEL_DEFAULTS[config.model], "attention": config.attention, "dtype": config.dtype,
                                  "checkpoint": config.checkpoint, "device": device})
            capture_backward(tiny)
        except ValueError:  # a combination the tiny twin refuses: the user's own capture will say so if it must
            pass


class _Packed:
    """What the saved-tensor pack hook hands autograd: the tensor (autograd frees it as usual) and an id."""

    __slots__ = ("index", "tensor")

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self.index = index
        self.tensor = tensor


@dataclass
class _Save:
    shape: tuple[int, ...]
    dtype: str
    storage_key: int
    storage_bytes: int
    is_parameter: bool


class _FlopCounter(TorchDispatchMode):
    """Adds the FLOPs of every aten op to whichever bucket the run currently charges."""

    def __init__(self, run: _Run) -> None:
        super().__init__()
        self.run = run
        self.meta = run.device == "meta"

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Otherwise TorchDispatchMode wraps __torch_dispatch__ in torch._dynamo.disable, whose first call
        # imports torch._dynamo (1-2 s) and which adds a frame to every aten call. Nothing here is compiled.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func is _GROUPED_MM and self.meta:
            out = _grouped_mm_on_meta(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        run = self.run
        formula, name = op_info(func)
        if formula is not None:
            flops = int(formula(*args, out_val=out, **kwargs))
            if flops:
                run.charge(flops, name)
        run.storages.observe(func, out)  # the memory timeline: one dispatch mode for both
        return out


_GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)
if _GROUPED_MM is not None:
    _GROUPED_MM = _GROUPED_MM.default


def _grouped_mm_on_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """`_grouped_mm`'s output on meta for every dtype the CPU kernel takes (a mixture of experts' GEMMs).

    torch's meta kernel repeats CUDA's checks and refuses float32, which the CPU runs; the capture's dispatch mode
    answers meta calls itself, with the CPU kernel's output shape, so a float32 dry run keeps the same graph (autograd
    has recorded the call already, above the mode). Shapes: 2-D x 3-D (rows, k) x (groups, k, n) -> (rows, n); 2-D x
    2-D (the weight gradient, split by offs) -> (groups, m, n); 3-D x 2-D -> (m, n); 3-D x 3-D -> (groups, m, n).
    """
    groups = offs.shape[0] if offs is not None else None
    if mat_a.dim() == 2:
        shape = (groups, mat_a.shape[0], mat_b.shape[1]) if mat_b.dim() == 2 else (mat_a.shape[0], mat_b.shape[-1])
    else:
        shape = (mat_a.shape[1], mat_b.shape[1]) if mat_b.dim() == 2 else (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device="meta")


# One meta forward at a time may swap F.scaled_dot_product_attention (see _fused_attention_on_meta).
_META_SDPA_LOCK = threading.Lock()


@contextlib.contextmanager
def _fused_attention_on_meta(cuda: bool) -> Iterator[None]:
    """On meta, SDPA takes its unfused math path; route meta calls to the fused kernel a real device runs.

    The target is this build's CPU kernel, or CUDA's (efficient for float32, flash for half) where `auto`
    picks CUDA, so a meta dry run shows the graph the real run would have. nn.MultiheadAttention calls SDPA
    through the same module global, so swapping it covers both; calls on other devices (other threads'
    captures) go to the original untouched.
    """
    original = F.scaled_dot_product_attention
    aten = torch.ops.aten

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "meta":
            return original(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if not cuda:
            out, _lse = aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )
            return out
        if q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None:
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(~bias, float("-inf"))
        return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]

    with _META_SDPA_LOCK:
        F.scaled_dot_product_attention = sdpa
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original


_next_sequence_nr = torch._C._autograd._get_sequence_nr  # the number autograd gives the next node this thread makes


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage._cdata, storage.nbytes()


_SAVED_FIELDS: dict[type, tuple[str, ...]] = {}


def _saved_fields(node: object) -> tuple[str, ...]:
    kind = type(node)
    if kind not in _SAVED_FIELDS:
        names = tuple(n for n in dir(node) if n.startswith("_saved_"))
        if hasattr(node, "saved_tensors"):  # custom autograd.Function nodes
            names += ("saved_tensors",)
        _SAVED_FIELDS[kind] = names
    return _SAVED_FIELDS[kind]


class _Run:
    """The mutable state of one capture; `capture()` turns it into a frozen Capture."""

    def __init__(
        self, config: ModelConfig, device: str, say: Progress, check: Callable[[], None], source: Source | None = None
    ) -> None:
        self.config = config
        self.source = source
        self.device = device
        self.say = say
        self.check = check  # raises CaptureCancelled; called at module and node boundaries
        self.real = device != "meta"
        # forward
        self.phase = "setup"
        self.labels: dict[object, str] = {}  # autograd node -> module path
        self.open_calls: list[int] = []  # forward: the next sequence number when each running module call started
        self.calls: list[tuple[int, int, int, str, bool]] = []  # (depth, first, end, path, checkpointed) per call
        self.saves: list[_Save] = []
        self.checkpoint_held: dict[int, int] = {}  # storage key -> bytes
        self.recomputed_nodes: set = set()  # their saved fields are checkpoint placeholders
        # graph walk
        self.collecting: list[int] | None = None
        # backward
        self.current: str | None = None
        self.flops_forward = 0
        self.flops_by_node: Counter[str] = Counter()
        self.recompute_by_node: Counter[str] = Counter()
        self.flops_unattributed = 0
        self.flops_forward_by_module_op: Counter[tuple[str, str]] = Counter()  # (innermost module, aten op)
        self.flops_by_op: dict[str, Counter[str]] = {"forward": Counter(), "backward": Counter()}
        self.io_bytes: dict[str, int] = {}  # node id -> bytes of the gradients it read and wrote
        self.started: dict[str, object] = {}
        self.ended: dict[str, object] = {}
        self.norm_parts: dict[str, list[torch.Tensor]] = {}
        self.norms_seen: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(gradient) -> (ref, its norm)
        self.last_finished: str | None = None  # the engine sums gradients right after their producer's hooks
        self.sums_after: Counter[str] = Counter()  # producer node id -> FLOPs of the sums that followed it
        self.backward_order: list[str] = []
        self.node_hooks: list = []
        self.param_names: dict = {}
        self.module_paths: dict = {}
        self.storages = StorageObserver(device)  # the memory timeline (fed by this run's mode and hooks)

    def release(self) -> None:
        """Drop every reference to autograd nodes, modules and tensors. The node hooks' closures point back
        at this object, so without this the model and its gradients would live until a cyclic GC pass."""
        for handle in self.node_hooks:
            handle.remove()
        self.storages.release()
        for store in (self.node_hooks, self.labels, self.calls, self.recomputed_nodes, self.started,
                      self.ended, self.norm_parts, self.norms_seen, self.param_names, self.module_paths):
            store.clear()

    # ---- hooks -------------------------------------------------------------------------------------

    def charge(self, flops: int, op: str) -> None:
        """Count `flops` of aten op `op` (its packet's name) where the run is now."""
        if self.phase in self.flops_by_op:
            self.flops_by_op[self.phase][op] += flops
        if self.phase == "forward":
            self.flops_forward += flops
            stack = self.storages.module_stack  # the timeline's: the modules whose forward is running, innermost last
            self.flops_forward_by_module_op[stack[-1] if stack else "", op] += flops
        elif self.current is None:
            self.flops_unattributed += flops
            if self.last_finished is not None:
                self.sums_after[self.last_finished] += flops
        else:
            self.flops_by_node[self.current] += flops
            if self.storages.recompute_depth:  # > 0 while checkpointing re-runs a forward inside backward
                self.recompute_by_node[self.current] += flops

    def pack(self, tensor: torch.Tensor) -> _Packed:
        key, nbytes = _storage_key(tensor)
        self.saves.append(
            _Save(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), key, nbytes, key in self.param_storages)
        )
        return _Packed(len(self.saves) - 1, tensor)

    def unpack(self, packed: _Packed) -> torch.Tensor:
        if self.collecting is not None:
            self.collecting.append(packed.index)
        return packed.tensor

    def module_pre(self, module, args, kwargs):
        path = self.module_paths[module]
        self.storages.module_entered(path)  # the timeline's module, from the same hook
        if self.phase == "forward":
            self.open_calls.append(_next_sequence_nr())
            if getattr(module, RECOMPUTED, False):
                for t in tensors_in((args, kwargs)):
                    key, nbytes = _storage_key(t)
                    if key not in self.param_storages:
                        self.checkpoint_held[key] = nbytes
        # Last: a cancel raised here still meets this module's post hook (always_call), which pops what was pushed
        # above ("pop from empty list" in the server's log when it was checked first).
        self.check()

    def module_post(self, module, args, kwargs, output):
        self.storages.module_left()
        if self.phase != "forward":
            return
        start = self.open_calls.pop()
        self.calls.append(
            (len(self.open_calls), start, _next_sequence_nr(), self.module_paths[module], getattr(module, RECOMPUTED, False))
        )

    def _label(self, nodes: list, ops: dict) -> None:
        """Each node's module: the innermost module whose forward call was running when autograd created it.

        Autograd numbers the nodes a thread creates in order (`_sequence_nr`); each module call recorded the range
        of numbers given out between its pre and post hooks. Ranges nest as the calls do, so painting them
        outermost first leaves each number with its innermost module. (This replaced a walk from every module's
        output back to its inputs, which visited each node once per enclosing module.) Nodes made inside a
        checkpointed module are marked too: their saved fields are checkpoint placeholders.
        """
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
        for node in nodes:
            index = node._sequence_nr() - base
            if 0 <= index < size and owner[index] is not None and ops[node] != "AccumulateGrad":
                self.labels[node] = owner[index]
                if recomputed[index]:
                    self.recomputed_nodes.add(node)

    def node_pre(self, node_id: str):
        def hook(grad_outputs):
            self.check()
            self.current = node_id
            self.backward_order.append(node_id)
            self.storages.node_started(node_id)  # the timeline's step, from the same hook
            self.started[node_id] = self._clock()

        return hook

    def node_post(self, node_id: str, is_leaf: bool):
        def hook(grad_inputs, grad_outputs):
            self.ended[node_id] = self._clock()
            self.current = None
            self.last_finished = node_id
            self.io_bytes[node_id] = sum(g.nbytes for g in (*grad_inputs, *grad_outputs) if g is not None)
            if self.real:
                # Bookkeeping, not the model's work: the capture's own dispatch mode (FLOPs, timeline) never sees it.
                with torch._C._DisableTorchDispatch():
                    self.norm_parts[node_id] = [self._norm_once(g) for g in (grad_outputs if is_leaf else grad_inputs)
                                                if g is not None]

        return hook

    def _norm_once(self, g: torch.Tensor) -> torch.Tensor:
        """The L2 norm of one gradient, read once however many nodes it passes through: a parameter's gradient
        is sent by one node and received by its AccumulateGrad, an add sends the same tensor down both paths.
        Keyed by the Python object (PyTorch keeps one per live tensor), checked with a weak reference so a
        recycled id never returns another tensor's norm."""
        seen = self.norms_seen.get(id(g))
        if seen is not None and seen[0]() is g:
            return seen[1]
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        self.norms_seen[id(g)] = (weakref.ref(g), norm)
        return norm

    def _clock(self) -> object:
        if self.device == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    # ---- phases ------------------------------------------------------------------------------------

    def capture(self) -> Capture:
        config, device = self.config, self.device
        self.say("building the model")
        if self.source is None:
            if device == "cpu":  # the default device: torch.device()'s hook on every call costs ~1.5 ms here
                model = build_model(config)
            else:
                with torch.device(device):
                    model = build_model(config)
            batch = make_batch(config, device)
            inputs, loss_of = (batch.inputs,), lambda out: compute_loss(config, out, batch.targets)
            held = (batch.inputs, batch.targets)
        else:
            model, inputs, loss_of = self.source.model, self.source.inputs, self.source.loss_fn
            held = inputs
        self.param_names = {p: name for name, p in model.named_parameters()}
        self.param_storages = {_storage_key(p)[0] for p in model.parameters()}
        self.module_paths = {m: name for name, m in model.named_modules()}
        handles = [m.register_forward_pre_hook(self.module_pre, with_kwargs=True) for m in model.modules()]
        handles += [m.register_forward_hook(self.module_post, with_kwargs=True, always_call=True) for m in model.modules()]
        self.storages.track_existing(model.parameters(), parameters=True)
        self.storages.track_existing(held, parameters=False)
        peak = baseline = None
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()

        if config.checkpoint != "none":
            # checkpoint() is wrapped in torch._disable_dynamo, whose first call imports torch._dynamo (1-2 s):
            # a one-time cost of the process, paid here so the timed forward measures the model.
            importlib.import_module("torch._dynamo")

        self.say("running the forward pass")
        self.phase = "forward"
        started, started_cpu = time.perf_counter(), time.thread_time()
        self.storages.forward()
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack), _FlopCounter(self):
            output = model(*inputs)
            loss = loss_of(output)
        synchronize(device)
        forward_s, forward_cpu_s = time.perf_counter() - started, time.thread_time() - started_cpu
        self.phase = "walk"
        del output

        self.say("walking the autograd graph")
        nodes = autograd_nodes(loss.grad_fn)
        ops = {node: normalise_op(node.name()) for node in nodes}
        self._label(nodes, ops)
        ids = {node: f"{ops[node]}:{i}" for i, node in enumerate(nodes)}
        saves_of = self._collect_saves(nodes, ids)
        saved = {self.saves[i].storage_key for found in saves_of.values() for i in found if not self.saves[i].is_parameter}
        self.storages.end_forward(saved, self.checkpoint_held)
        for node in nodes:
            self.node_hooks.append(node.register_prehook(self.node_pre(ids[node])))
            self.node_hooks.append(node.register_hook(self.node_post(ids[node], ops[node] == "AccumulateGrad")))

        self.say("running the backward pass")
        self.phase = "backward"
        started, started_cpu = time.perf_counter(), time.thread_time()
        self.storages.backward()
        with _FlopCounter(self):
            loss.backward()
        synchronize(device)
        backward_s, backward_cpu_s = time.perf_counter() - started, time.thread_time() - started_cpu
        self.phase = "done"
        self.storages.end_backward(model.parameters())
        for handle in handles:
            handle.remove()
        if device == "cuda":
            peak = torch.cuda.max_memory_allocated()

        self.say("annotating the graph")
        cpu = (forward_cpu_s, backward_cpu_s) if device == "cpu" else (None, None)
        return self._build(model, nodes, ops, ids, saves_of, loss, (forward_s, backward_s, *cpu), peak, baseline)

    def _collect_saves(self, nodes: list, ids: dict) -> dict[str, list[int]]:
        """Node id -> indices (into self.saves) of the tensors saved for that node's backward."""
        saves_of: dict[str, list[int]] = {}
        for node in nodes:
            found: list[int] = []
            if node in self.recomputed_nodes:
                # Reading these fields would run checkpoint's unpack hook, i.e. the recomputation.
                saves_of[ids[node]] = found
                continue
            self.collecting = found
            for name in _saved_fields(node):
                try:
                    getattr(node, name)
                except RuntimeError:  # a field that is freed or undefined for this node
                    continue
            self.collecting = None
            saves_of[ids[node]] = sorted(set(found))
        return saves_of

    def _build(self, model, nodes, ops, ids, saves_of, loss, times, peak, baseline) -> Capture:
        graph = nx.DiGraph()
        owner: dict[int, str] = {}  # storage key -> node id that the storage's bytes are charged to
        first_save: dict[int, int] = {}
        for node_id, indices in saves_of.items():
            for index in indices:
                key = self.saves[index].storage_key
                if not self.saves[index].is_parameter and (key not in first_save or index < first_save[key]):
                    first_save[key] = index
                    owner[key] = node_id
        save_events = []
        node_of_save = {index: node_id for node_id, indices in saves_of.items() for index in indices}
        for index, save in enumerate(self.saves):
            if index not in node_of_save:
                continue  # saved for a node that backward never reaches from the loss
            counted = not save.is_parameter and first_save.get(save.storage_key) == index
            save_events.append(
                SaveEvent(index, node_of_save[index], save.shape, save.dtype, save.storage_bytes, counted)
            )
        # The owning module's type refines categories (graphviz_core.categories.category_in_module).
        module_types = {path: type(m).__name__ for m, path in self.module_paths.items()}
        counted_bytes = Counter()
        for event in save_events:
            if event.counted:
                counted_bytes[event.node] += event.storage_bytes
        parameter_count = 0
        parameter_bytes = 0
        saves = self.saves
        position: dict[str, int] = {}
        for index, node_id in enumerate(self.backward_order):
            position.setdefault(node_id, index)
        by_category: Counter[str] = Counter()
        by_op: Counter[str] = Counter()
        saved_by_category: Counter[str] = Counter()
        flops_by_category: Counter[str] = Counter()
        norms = self._norm_values()
        records = []
        for node in nodes:
            node_id, op = ids[node], ops[node]
            param = None
            path = self.labels.get(node)
            module = path or ""
            if op == "AccumulateGrad":
                tensor = node.variable
                name = self.param_names.get(tensor, "")
                param = {"name": name, "shape": list(tensor.shape)}
                module = name.rpartition(".")[0]
                parameter_count += tensor.numel()
                parameter_bytes += tensor.numel() * tensor.element_size()
            category = category_in_module(op, module_types[path] if path is not None else "")
            saved_bytes = counted_bytes[node_id]
            flops = self.flops_by_node[node_id]
            by_category[category] += 1
            by_op[op] += 1
            saved_by_category[category] += saved_bytes
            flops_by_category[category] += flops
            saved = []
            for i in saves_of[node_id]:
                save = saves[i]
                key = save.storage_key
                saved.append({"shape": list(save.shape), "dtype": save.dtype, "bytes": save.storage_bytes,
                              "counted": owner.get(key) == node_id and first_save.get(key) == i,
                              "parameter": save.is_parameter})
            records.append((node_id, {
                "op": op,
                "category": category,
                "module": module,
                "saved_bytes": saved_bytes,
                "flops": flops,
                "recompute_flops": self.recompute_by_node[node_id],
                "grad_io_bytes": self.io_bytes.get(node_id, 0),
                "time_s": self._elapsed(node_id),
                "grad_norm": self._norm(node_id, norms),
                "param": param,
                "saved": saved,
                "backward_index": position.get(node_id),
                "recomputed": node in self.recomputed_nodes,
                "gradient_sum_flops": 0,
            }))
        graph.add_nodes_from(records)
        graph.add_edges_from((ids[node], ids[child]) for node in nodes for child, _ in node.next_functions
                             if child is not None)

        self._place_gradient_sums(graph)
        backward_total = sum(self.flops_by_node.values()) + self.flops_unattributed
        forward_by_module: Counter[str] = Counter()
        by_module_op: dict[str, dict[str, int]] = {}
        for (module_path, op_name), flops in self.flops_forward_by_module_op.items():
            forward_by_module[module_path] += flops
            by_module_op.setdefault(module_path, {})[op_name] = flops
        checkpoint_held = sum(b for key, b in self.checkpoint_held.items() if key not in first_save)
        # Outputs a selective-checkpoint policy kept (graphviz_core.families): stored by the checkpoint, not hooks.
        checkpoint_held += getattr(model, "selective_checkpoint_kept_bytes", 0)
        real = self.real
        timeline = self.storages.timeline(lambda n: graph.nodes[n]["module"] if n in graph else "")
        return Capture(
            config=self.config,
            device=self.device,
            graph=graph,
            summary=GraphSummary(
                nodes=graph.number_of_nodes(),
                edges=graph.number_of_edges(),
                by_category=dict(sorted(by_category.items())),
                by_op=dict(sorted(by_op.items())),
                parameters=by_category.get("accumulate_grad", 0),
                parameter_count=parameter_count,
            ),
            memory=MemorySummary(
                saved_bytes=sum(counted_bytes.values()),
                parameter_bytes=parameter_bytes,
                gradient_bytes=parameter_bytes,
                peak_bytes=peak if peak is not None else timeline.peak_bytes,
                baseline_bytes=baseline,
                checkpoint_held_bytes=checkpoint_held,
                saved_bytes_by_category={k: v for k, v in sorted(saved_by_category.items()) if v},
            ),
            flops=FlopSummary(
                forward=self.flops_forward,
                backward=backward_total,
                backward_by_category={k: v for k, v in sorted(flops_by_category.items()) if v},
                backward_unattributed=self.flops_unattributed,
                backward_recompute=sum(self.recompute_by_node.values()),
                forward_by_module=dict(sorted(forward_by_module.items())),
                forward_by_op=dict(sorted(self.flops_by_op["forward"].items())),
                backward_by_op=dict(sorted(self.flops_by_op["backward"].items())),
                forward_by_module_op={m: dict(sorted(ops.items())) for m, ops in sorted(by_module_op.items())},
            ),
            time=TimeSummary(*times) if real else TimeSummary(None, None),
            loss=float(loss.detach()) if real else None,
            save_order=tuple(save_events),
            backward_order=tuple(self.backward_order),
            timeline=timeline,
        )

    def _place_gradient_sums(self, graph: nx.DiGraph) -> None:
        """Charge each sum the engine ran between nodes to the node whose input it summed (`gradient_sum_flops`).

        The engine adds a gradient into a node's input buffer right after the producer's hooks ran, when that
        buffer already holds a gradient from another producer; so the receiver is the producer's successor
        with another producer that finished earlier.
        """
        position = {node_id: i for i, node_id in enumerate(self.backward_order)}
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

    def _elapsed(self, node_id: str) -> float | None:
        if not self.real or node_id not in self.ended:
            return None
        start, end = self.started[node_id], self.ended[node_id]
        if self.device == "cuda":
            return start.elapsed_time(end) / 1000.0
        return end - start

    def _norm(self, node_id: str, values: dict[int, float]) -> float | None:
        parts = self.norm_parts.get(node_id)
        if not parts:
            return None
        return math.sqrt(sum(values[id(p)] ** 2 for p in parts))

    def _norm_values(self) -> dict[int, float]:
        """id(norm tensor) -> its value, read in one transfer (one sync on CUDA, instead of one per gradient)."""
        unique = {id(p): p for parts in self.norm_parts.values() for p in parts}
        if not unique:
            return {}
        return dict(zip(unique, torch.stack(list(unique.values())).tolist(), strict=True))


def autograd_nodes(root) -> list:
    """Every node reachable from `root`, in deterministic pre-order (next_functions order)."""
    order, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(reversed([n for n, _ in node.next_functions if n is not None]))
    return order
