"""Runs one instrumented forward + backward pass and returns the annotated autograd graph as a `Capture`.

This is the only place that calls `.backward()` on a model. The engine runs the phases; what is measured is up to
the instruments (graphviz_core.capture.instruments), each one observer of the run:

1. build   the model, its batch and loss (or the user's own module), parameters known
2. forward module hooks around every call, saved-tensor hooks, one dispatch mode for every aten op
3. walk    every node reachable from the loss gets a deterministic id (op name and pre-order index)
4. backward node hooks before and after each node's backward
5. build   the networkx graph of graph/schema.py's records, each instrument annotating its fields, then the summaries

A caller asks only for the instruments it needs (`instruments=`): the graph alone (nodes, edges, categories,
modules) runs no dispatch mode and no node hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection

import networkx as nx
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphviz_core.capture import plain_names, step_gate
from graphviz_core.capture.admission import CaptureCancelled, Ticket, admit
from graphviz_core.capture.autocast import (
    autocast_context,
    autocast_device_type,
    autocast_observer,
    fake_device,
    on_fake_device,
    outside_fake_mode,
    scaled,
    scaler_note,
    uses_fake_tensors,
)
from graphviz_core.capture.device import cuda_index, device_guard, resolve_device, synchronize
from graphviz_core.capture.gc_pause import no_cyclic_gc
from graphviz_core.capture.instrument import Instrument, Run, overrides
from graphviz_core.capture.instruments.flops import FlopCounter
from graphviz_core.capture.instruments.modules import ModuleTracker
from graphviz_core.capture.instruments.norms import GradientNorms
from graphviz_core.capture.instruments.optimizer import OptimizerStep
from graphviz_core.capture.instruments.order import BackwardOrder
from graphviz_core.capture.instruments.saved import SavedTensors
from graphviz_core.capture.instruments.timing import NodeTiming
from graphviz_core.capture.meta_kernels import (
    GROUPED_MM,
    NORM_STATISTICS,
    SDPA_SWAP_LOCK,
    fused_attention_on_meta,
    grouped_mm_on_meta,
    statistics_in_fp32,
)
from graphviz_core.capture.result import (
    AutocastSummary,
    Capture,
    FlopSummary,
    GraphSummary,
    MemorySummary,
    TimeSummary,
)
from graphviz_core.capture.timeline import StorageObserver
from graphviz_core.capture.walk import autograd_nodes, storage_key
from graphviz_core.config import ModelConfig
from graphviz_core.graph.categories import category_in_module, normalise_op
from graphviz_core.models.family import Source
from graphviz_core.models.model_files import first_line
from graphviz_core.models.registry import build_model, compute_loss, make_batch

Progress = Callable[[str], None]

# Every instrument, in the order their hooks run (node_post hooks in reverse, so timing's clock is innermost).
INSTRUMENTS: dict[str, type[Instrument]] = {
    "saved": SavedTensors,
    "order": BackwardOrder,
    "flops": FlopCounter,
    "timeline": StorageObserver,
    "norms": GradientNorms,
    "timing": NodeTiming,
    "optimizer": OptimizerStep,  # after the backward: the config's torch.optim optimizer, one step, its state
}
GRAPH_ONLY: frozenset[str] = frozenset()  # nodes, edges, categories and modules: module attribution alone


def capture_backward(
    config: ModelConfig,
    progress: Progress | None = None,
    ticket: Ticket | None = None,
    source: Source | None = None,
    instruments: Collection[str] | None = None,
) -> Capture:
    """Build the model, run forward + backward once with instrumentation, and return the Capture.

    `source` replaces the model, batch and loss that `config` would build (graphviz_core.capture.own_module passes a
    user's own module this way). `instruments` names the instruments to run (INSTRUMENTS' keys; None: all, the
    graph's every field; GRAPH_ONLY: the graph's nodes, edges, categories and modules alone); what is not measured
    keeps the schema's neutral value (0 bytes and FLOPs, no time, no norm). Raises ValueError (CaptureError) with an
    actionable sentence for configs that cannot run here, and CaptureCancelled when `ticket` is cancelled (checked
    while queued and at every module and node).
    """
    if source is None:
        source = config.family.source(config)  # a trusted-folder model picked in the web app
    if source is None:
        return _capture(config, progress, ticket, None, instruments)
    try:
        return _capture(config, progress, ticket, source, instruments)
    except (ValueError, CaptureCancelled):
        raise
    except Exception as exc:  # the user's forward or loss raised: one sentence, no traceback
        raise ValueError(f"{config.preset} raised {type(exc).__name__} during the capture: {first_line(exc)}") from None


def _capture(config: ModelConfig, progress: Progress | None, ticket: Ticket | None, source: Source | None,
             instruments: Collection[str] | None) -> Capture:
    say = progress or (lambda phase: None)
    _refuse_unbuilt(config)
    chosen = _with_needs(INSTRUMENTS if instruments is None else instruments)
    device = resolve_device(config.device)
    if device != "meta":
        warm_up(device)
        if source is None:
            _warm_family(config, device)
    # On meta, mirror the attention kernels of the device `auto` would pick (GRAPHVIZ_CORE_DEVICE included),
    # and for the backward too: checkpointing recomputes there.
    meta_kernels = contextlib.nullcontext()
    if device == "meta":
        meta_kernels = fused_attention_on_meta(resolve_device("auto") == "cuda")
        if SDPA_SWAP_LOCK.locked():  # the page's line said "waiting for its turn", as if queued behind real runs
            say("waiting for the dry run or parallel simulation before it (in one process they take turns)")
    compiled = _compiled_regions(config, device, say, ticket, source) if config.compile else None
    where = _source_gpu(source) if device == "cuda" and source is not None else device  # "cuda": admission places it
    with admit(config, where, ticket) as admitted, _exclusive(compiled):  # waits its turn; reserves the bytes
        run = Run(config, device, admitted.check)
        run.instruments = {"modules": ModuleTracker(), **autocast_observer(config),
                           **{name: INSTRUMENTS[name]() for name in chosen}}
        if compiled is not None:
            run.instruments["compiled"] = compiled
        # Placed on one GPU ("cuda:N"): the run says "cuda" and that GPU is the thread's current device, so the model,
        # the batch, CUDA events, synchronize and max_memory_allocated all land on it.
        gpu = cuda_index(admitted.device or "")
        on_gpu = torch.cuda.device(gpu) if gpu is not None else contextlib.nullcontext()
        try:
            with on_gpu, device_guard(device), meta_kernels, no_cyclic_gc(), fake_device(run):
                capture = _Phases(run, say, source).capture()
        finally:
            run.release()
        return capture if gpu is None else dataclasses.replace(capture, device=admitted.device)


def _source_gpu(source: Source) -> str:
    """The GPU a user's module already sits on, "cuda:N" (its capture runs there); "cuda" when it is not on one."""
    first = next(iter(source.model.parameters()), None)
    if first is None:
        first = next((t for t in source.inputs if isinstance(t, torch.Tensor)), None)
    if first is None or first.device.type != "cuda":
        return "cuda"
    return f"cuda:{first.device.index if first.device.index is not None else torch.cuda.current_device()}"


# Training-step settings the config accepts whose capture is still being built: refused, never silently ignored.
_UNBUILT: dict[str, tuple] = {}


def _refuse_unbuilt(config: ModelConfig) -> None:
    for name, (default, flag) in _UNBUILT.items():
        if getattr(config, name) != default:
            raise ValueError(f"{flag} is not available in this version yet; leave {name} at {default!r}.")


def _compiled_regions(config: ModelConfig, device: str, say: Progress, ticket: Ticket | None, source: Source | None):
    """--compile: the eager step's saved bytes first (the figure compile is compared with), then the instrument
    that compiles the model (graphviz_core.capture.compiled; importing it imports torch._dynamo)."""
    from graphviz_core.capture.compiled import CompiledRegions, check_compile

    check_compile(config, device)
    say("capturing the eager step first (its saved bytes, beside the compiled step's)")
    eager = capture_backward(dataclasses.replace(config, compile=False), None, ticket, source, instruments={"saved"})
    return CompiledRegions(eager.memory.saved_bytes)


@contextlib.contextmanager
def _exclusive(compiled):
    """A compiled capture runs alone in this process (graphviz_core.capture.step_gate), the others side by side."""
    if compiled is None:
        with step_gate.shared():
            yield
        return
    with step_gate.alone(), compiled.exclusive():
        yield


def _with_needs(names: Collection[str]) -> list[str]:
    """The instruments asked for and those they read, in INSTRUMENTS' order."""
    unknown = set(names) - set(INSTRUMENTS)
    if unknown:
        raise ValueError(f"unknown instrument(s) {', '.join(sorted(unknown))}; choose from {', '.join(INSTRUMENTS)}.")
    wanted = set(names)
    while True:
        more = {need for name in wanted for need in INSTRUMENTS[name].needs} - wanted
        if not more:
            return [name for name in INSTRUMENTS if name in wanted]
        wanted |= more


class _OpObserver(TorchDispatchMode):
    """One dispatch mode for every instrument that watches aten ops; on meta it also answers the grouped matmul
    with the CPU kernel's shapes (graphviz_core.capture.meta_kernels)."""

    def __init__(self, observers: list[Callable], meta: bool) -> None:
        super().__init__()
        self.observers = observers
        self.meta = meta

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Otherwise TorchDispatchMode wraps __torch_dispatch__ in torch._dynamo.disable, whose first call
        # imports torch._dynamo (1-2 s) and which adds a frame to every aten call. Nothing here is compiled.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func is GROUPED_MM and self.meta:
            out = grouped_mm_on_meta(*args, **kwargs)
        elif func in NORM_STATISTICS and self.meta:
            out = statistics_in_fp32(func(*args, **kwargs), args[0])
        else:
            out = func(*args, **kwargs)
        for observe in self.observers:
            observe(func, args, kwargs, out)
        return out


class _CompiledOpObserver(_OpObserver):
    """The op observer of a compiled step: dynamo runs the compiled code beside it (a mode that does not ignore
    compile internals makes dynamo fall back to eager), and it sees the aten ops the compiled graphs run."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class _Phases:
    """The phases of one capture over one Run; `capture()` returns the frozen Capture."""

    def __init__(self, run: Run, say: Progress, source: Source | None) -> None:
        self.run = run
        self.say = say
        self.source = source
        self.all = list(run.instruments.values())  # the module tracker first
        run.modules = run.instruments["modules"]
        self.reshape_views = plain_names.ReshapeViews()  # the forward's views the mode may have renamed
        self.renamed_note = ""

    def hooked(self, hook: str) -> list[Instrument]:
        return [i for i in self.all if overrides(i, hook)]

    def op_mode(self, forward: bool = False) -> contextlib.AbstractContextManager:
        observers = [i.on_op for i in self.hooked("on_op")]
        if observers or self.run.device == "meta":
            if forward:
                observers.append(self.reshape_views.observe)
            kind = _CompiledOpObserver if self.run.instrument("compiled") is not None else _OpObserver
            return kind(observers, self.run.device == "meta")
        return contextlib.nullcontext()

    def capture(self) -> Capture:
        run, config, device = self.run, self.run.config, self.run.device
        self.say("building the model")
        model, inputs, loss_of = self.build()
        run.model = model
        run.param_storages = {storage_key(p)[0] for p in model.parameters()}
        call, handles = self.compiled_call(model, inputs, loss_of)
        for instrument in self.all:
            instrument.start(run)
        baseline = None
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        if config.checkpoint != "none":
            # checkpoint() is wrapped in torch._disable_dynamo, whose first call imports torch._dynamo (1-2 s):
            # a one-time cost of the process, paid here so the timed forward measures the model.
            importlib.import_module("torch._dynamo")

        self.say("running the forward pass")
        run.phase = "forward"
        started, started_cpu = time.perf_counter(), time.thread_time()
        with contextlib.ExitStack() as forward:
            for instrument in self.all:
                for context in instrument.forward_contexts(run):
                    forward.enter_context(context)
            forward.enter_context(self.op_mode(forward=True))
            forward.enter_context(autocast_context(run))
            output = call(*inputs)
            loss = loss_of(output)
            root = scaled(run, loss)  # float16 autocast: backward starts from the GradScaler's scaled loss
        synchronize(device)
        forward_s, forward_cpu_s = time.perf_counter() - started, time.thread_time() - started_cpu
        run.phase = "walk"
        del output
        self.notes = [note for note in (scaler_note(run),) if note]  # before backward: the scale it started with

        self.say("walking the autograd graph")
        self.walk(root)
        node_hooks = self.node_hooks()

        self.say("running the backward pass")
        run.phase = "backward"
        started, started_cpu = time.perf_counter(), time.thread_time()
        with self.op_mode():
            root.backward()
        del root
        synchronize(device)
        backward_s, backward_cpu_s = time.perf_counter() - started, time.thread_time() - started_cpu
        run.phase = "done"
        # Read before the instruments that run after backward: the optimizer's step (its state) and the gradient norms
        # allocate too, and the peak is that of forward + backward (seen on an H200: gpt2-small b=4 s=256 read
        # 2,566,980,608 bytes after AdamW's step, 770 MB above every sample the backward took).
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        for instrument in self.hooked("after_backward"):
            instrument.after_backward(run)
        for handle in (*handles, *node_hooks):
            handle.remove()

        self.say("annotating the graph")
        cpu = (forward_cpu_s, backward_cpu_s) if device == "cpu" else (None, None)
        times = TimeSummary(forward_s, backward_s, *cpu) if run.real else TimeSummary(None, None)
        return self.result(model, loss, times, peak, baseline)

    def build(self) -> tuple[torch.nn.Module, tuple, Callable]:
        """The model, its inputs and the loss of its output; the batch (or the user's inputs) is held by the run."""
        run, config = self.run, self.run.config
        if self.source is not None:
            if uses_fake_tensors(run):  # its module is already built, on meta, where autocast casts nothing
                raise ValueError("a dry run under autocast needs a model the app builds; run your own module under "
                                 "autocast on cpu (or cuda), or drop autocast on meta.")
            run.held = self.source.inputs
            return self.source.model, self.source.inputs, self.source.loss_fn
        with outside_fake_mode(run):  # a dry run under autocast builds on meta, then goes fake (capture.autocast)
            if run.device == "cpu":  # the default device: torch.device()'s hook on every call costs ~1.5 ms here
                model = build_model(config)
            else:
                with torch.device(run.device):
                    model = build_model(config)
            batch = make_batch(config, run.device)
        inputs, targets = batch.inputs, batch.targets
        if uses_fake_tensors(run):  # a dry run under autocast: fake tensors of a real device (capture.autocast)
            model, (inputs, targets) = on_fake_device(model, (inputs, targets), autocast_device_type(run.device))
        run.held = (inputs, targets)
        return model, (inputs,), lambda out: compute_loss(config, out, targets)

    def compiled_call(self, model: torch.nn.Module, inputs: tuple, loss_of: Callable) -> tuple[Callable, list]:
        """What the forward calls, and the module hooks: the model with its hooks; under --compile the compiled model
        (compiled here, by one uninstrumented step) and no hooks: dynamo would trace them into the compiled code."""
        compiled = self.run.instrument("compiled")
        if compiled is None:
            return model, self.module_hooks(model)
        self.say("compiling (torch.compile: dynamo, AOTAutograd, inductor's partitioner; no code generated)…")
        return compiled.compile(model, inputs, loss_of), []

    def module_hooks(self, model: torch.nn.Module) -> list:
        """One pre and one post hook on every module: the tracker, then the instruments that watch modules, then
        the cancel check (last: a cancel raised there still meets this module's post hook, which pops the stack)."""
        run, tracker = self.run, self.run.modules
        watchers = [i.module_pre for i in self.hooked("module_pre")]
        leavers = [i.module_post for i in self.hooked("module_post")]
        paths = {m: name for name, m in model.named_modules()}

        def pre(module, args, kwargs):
            path = paths[module]
            tracker.enter(module, path)
            for watch in watchers:
                watch(module, path, args, kwargs)
            run.check()

        def post(module, args, kwargs, output):
            path = paths[module]
            tracker.leave(module, path)
            for leave in leavers:
                leave(module, path)

        handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in model.modules()]
        handles += [m.register_forward_hook(post, with_kwargs=True, always_call=True) for m in model.modules()]
        return handles

    def walk(self, loss: torch.Tensor) -> None:
        """Deterministic ids for every node reachable from the loss, then each instrument's after-forward step."""
        run = self.run
        run.nodes = autograd_nodes(loss.grad_fn)
        run.ops = {node: normalise_op(node.name()) for node in run.nodes}
        self.name_as_a_plain_run()
        run.ids = {node: f"{run.ops[node]}:{i}" for i, node in enumerate(run.nodes)}
        for instrument in self.hooked("after_forward"):
            instrument.after_forward(run)

    def name_as_a_plain_run(self) -> None:
        """Where the capture's dispatch mode may have renamed a node (reshape's ReshapeAliasBackward0 read as
        ViewBackward0), the graph's notes say how many and why (graphviz_core.capture.plain_names)."""
        run = self.run
        numbers = self.reshape_views.sequence_nrs
        candidates = sum(run.ops[n] == "ViewBackward0" and n._sequence_nr() in numbers for n in run.nodes)
        if candidates:
            self.renamed_note = plain_names.note(candidates)

    def node_hooks(self) -> list:
        """A pre and a post hook on every node, when some instrument watches nodes: the cancel check and the node
        being run first, the instruments' pre hooks in order and their post hooks in reverse."""
        before = [i.node_pre for i in self.hooked("node_pre")]
        after = [i.node_post for i in reversed(self.hooked("node_post"))]
        if not before and not after:
            return []
        run = self.run

        def pre_hook(node_id: str):
            def hook(grad_outputs):
                run.check()
                run.current = node_id
                for observe in before:
                    observe(node_id)

            return hook

        def post_hook(node_id: str, is_leaf: bool):
            def hook(grad_inputs, grad_outputs):
                for observe in after:
                    observe(node_id, is_leaf, grad_inputs, grad_outputs)
                run.current = None
                run.last_finished = node_id

            return hook

        handles = []
        for node in run.nodes:
            node_id = run.ids[node]
            handles.append(node.register_prehook(pre_hook(node_id)))
            handles.append(node.register_hook(post_hook(node_id, run.ops[node] == "AccumulateGrad")))
        return handles

    def result(self, model, loss, times: TimeSummary, peak: int | None, baseline: int | None) -> Capture:
        run = self.run
        graph, summary, trainable_bytes = self.graph(model)
        frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        for instrument in self.hooked("finish"):
            instrument.finish(run, graph)
        saved, flops = run.instrument("saved"), run.instrument("flops")
        order, timeline = run.instrument("order"), run.instrument("timeline")
        timeline = timeline.result if timeline is not None else None
        if peak is None and timeline is not None:
            peak = timeline.peak_bytes
        return Capture(
            config=run.config,
            device=run.device,
            graph=graph,
            summary=summary,
            memory=MemorySummary(
                saved_bytes=saved.saved_bytes if saved else 0,
                parameter_bytes=trainable_bytes + frozen_bytes,
                buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
                gradient_bytes=trainable_bytes,
                peak_bytes=peak,
                baseline_bytes=baseline,
                checkpoint_held_bytes=saved.checkpoint_held_bytes if saved else 0,
                saved_bytes_by_category=saved.by_category if saved else {},
            ),
            flops=flops.summary if flops else FlopSummary(0, 0, {}, 0, 0),
            time=times,
            loss=float(loss.detach()) if run.real else None,
            save_order=saved.save_events if saved else (),
            backward_order=tuple(order.order) if order else (),
            timeline=timeline,
            compiled=getattr(run.instrument("compiled"), "summary", None),
            **self.training_parts(),
        )

    def training_parts(self) -> dict:
        """Capture's `optimizer`, `autocast` and `notes`: what torch.optim kept, what autocast did, and how."""
        run, notes = self.run, list(getattr(self, "notes", ()))
        stepper, casts = run.instrument("optimizer"), run.instrument("casts")
        state = stepper.result if stepper is not None else None
        autocast = None
        if casts is not None:
            device_type = autocast_device_type(run.device)
            autocast = AutocastSummary(run.config.autocast, device_type, len(casts.cast_ids), casts.weight_casts,
                                       casts.weight_copy_bytes, " ".join(notes))
            master = " (fp32 master weights)" if run.config.dtype == "float32" else ""
            notes.insert(0, f"Ops ran under torch.autocast({device_type!r}, {run.config.autocast}); the weights stayed "
                            f"{run.config.dtype}{master}: {len(casts.cast_ids):,} cast nodes, "
                            f"{casts.weight_casts:,} of them 16-bit copies of weights.")
        if state is not None:
            notes.extend(state.notes)
        if self.renamed_note:
            notes.append(self.renamed_note)
        return {"optimizer": state, "autocast": autocast, "notes": tuple(notes)}

    def graph(self, model) -> tuple[nx.DiGraph, GraphSummary, int]:
        """The graph of graph/schema.py's records: every key on every node, each instrument filling its own."""
        run, tracker = self.run, self.run.modules
        param_names = {p: name for name, p in model.named_parameters()}
        frozen = [p for p in param_names if not p.requires_grad]  # no AccumulateGrad node: autograd leaves them out
        annotators = [i.annotate for i in self.hooked("annotate")]
        by_category: Counter[str] = Counter()
        by_op: Counter[str] = Counter()
        parameter_count = parameter_bytes = 0
        records = []
        for node in run.nodes:
            node_id, op = run.ids[node], run.ops[node]
            param = None
            module = tracker.labels.get(node) or ""
            if op == "AccumulateGrad":
                tensor = node.variable
                name = param_names.get(tensor, "")
                param = {"name": name, "shape": list(tensor.shape)}
                module = name.rpartition(".")[0]
                parameter_count += tensor.numel()
                parameter_bytes += tensor.numel() * tensor.element_size()
            # The owning module's type refines categories (graphviz_core.graph.categories.category_in_module).
            category = category_in_module(op, tracker.module_type(node))
            by_op[op] += 1
            record = {
                "op": op, "category": category, "module": module, "saved_bytes": 0, "flops": 0, "recompute_flops": 0,
                "grad_io_bytes": 0, "time_s": None, "grad_norm": None, "param": param, "saved": [],
                "backward_index": None, "recomputed": node in tracker.recomputed_nodes, "gradient_sum_flops": 0,
            }
            for annotate in annotators:
                annotate(node_id, record)
            by_category[record["category"]] += 1  # after the instruments: autocast's casts are `cast`
            records.append((node_id, record))
        graph = nx.DiGraph()
        graph.add_nodes_from(records)
        ids = run.ids
        graph.add_edges_from((ids[node], ids[child]) for node in run.nodes for child, _ in node.next_functions
                             if child is not None)
        summary = GraphSummary(
            nodes=graph.number_of_nodes(),
            edges=graph.number_of_edges(),
            by_category=dict(sorted(by_category.items())),
            by_op=dict(sorted(by_op.items())),
            parameters=by_category.get("accumulate_grad", 0),
            parameter_count=parameter_count,
            frozen_parameters=len(frozen),
            frozen_parameter_count=sum(p.numel() for p in frozen),
        )
        return graph, summary, parameter_bytes


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
    Python), which makes a process's first forward of that kind take seconds where later ones take milliseconds;
    a compare page would show that inflated time as config A's. The tiny twin pays that cost instead.
    """
    key = (device, config.model, config.attention, config.dtype, config.checkpoint)
    with _WARM_LOCK:
        defaults = config.family.default_fields
        if key in _WARM_FAMILIES or not defaults:
            return
        _WARM_FAMILIES.add(key)  # before the capture below, which would otherwise warm itself
        try:
            tiny = ModelConfig(**{**defaults, "attention": config.attention, "dtype": config.dtype,
                                  "checkpoint": config.checkpoint, "device": device})
            capture_backward(tiny)
        except ValueError:  # a combination the tiny twin refuses: the user's own capture will say so if it must
            pass
