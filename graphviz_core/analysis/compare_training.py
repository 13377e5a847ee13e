"""The sentences that explain the training-step fields between two captures, each figure read from the captures:
autocast (cast nodes, saved bytes by dtype, the 16-bit weight copies), LoRA or frozen weights (AccumulateGrad nodes,
the weight-gradient matmuls a frozen weight no longer runs, gradients and optimizer state), torch.compile (compiled
nodes, saved bytes eager against compiled, the ops the compiled backward recomputes) and the optimizer (the state
torch.optim kept after one step, by key). compare_reasons calls these for its fields."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from graphviz_core.analysis.training_step import OPTIMIZER_NAMES, training_step_of

if TYPE_CHECKING:
    from graphviz_core.analysis.compare import Comparison
    from graphviz_core.capture.result import Capture

# Forward ops whose size is a linear weight's gradient matmul: dW = gᵀ·x costs what y = x·Wᵀ cost, 2·tokens·in·out.
WEIGHT_MATMULS = ("aten.mm", "aten.addmm", "aten.convolution")


def exact_bytes(n: int) -> str:
    return f"{n:,} B"


def _flops(n: int) -> str:
    return f"{n:,} FLOPs"


def _arrow(a: int, b: int, unit=exact_bytes) -> str:
    return f"{unit(a)} → {unit(b)}" if a != b else f"{unit(a)} both"


# --- autocast -------------------------------------------------------------------------------------------------------


def saved_by_dtype(capture: Capture) -> dict[str, int]:
    """Bytes saved for backward per dtype, each storage once, parameters left out (as memory.saved_bytes counts)."""
    by_dtype: Counter[str] = Counter()
    for save in capture.save_order:
        if save.counted:
            by_dtype[save.dtype] += save.storage_bytes
    return dict(by_dtype)


def _activations(capture: Capture) -> tuple[int, dict[str, int], int]:
    """(activation bytes, activation bytes per dtype, weight-copy bytes): what was saved for backward, autocast's
    16-bit copies of the weights split out."""
    by_dtype = saved_by_dtype(capture)
    copies = capture.autocast.weight_copy_bytes if capture.autocast else 0
    if copies:
        by_dtype[capture.autocast.dtype] = by_dtype.get(capture.autocast.dtype, 0) - copies
    return capture.memory.saved_bytes - copies, {k: v for k, v in by_dtype.items() if v}, copies


def autocast_sentence(c: Comparison, nodes: str, alone: bool, va: str, vb: str) -> str:
    """What torch.autocast did between A and B, in cast nodes and bytes."""
    a, b = c.a, c.b
    on = b if b.autocast else a  # the side that ran under autocast (either may, or both)
    casts_a, casts_b = (x.summary.by_category.get("cast", 0) for x in (a, b))
    weight_casts = on.autocast.weight_casts if on.autocast else 0
    dtype = on.autocast.dtype if on.autocast else "16-bit"
    head = (
        f"autocast {va} → {vb}: {nodes}; cast nodes (ToCopyBackward0, autocast's own) {casts_a} → {casts_b}, "
        f"{weight_casts} of them casting a float32 parameter (a weight or a bias) to {dtype} for its matmul. The weights stay in the "
        f"config's dtype (parameters {_arrow(a.memory.parameter_bytes, b.memory.parameter_bytes)}): they are the "
        "master weights the optimizer updates, and their gradients keep that dtype"
    )
    if not alone:
        return head + "."
    act_a, by_a, copies_a = _activations(a)
    act_b, by_b, copies_b = _activations(b)
    dtypes = sorted(set(by_a) | set(by_b), key=lambda d: -(by_a.get(d, 0) + by_b.get(d, 0)))
    split = ", ".join(f"{d} {_arrow(by_a.get(d, 0), by_b.get(d, 0))}" for d in dtypes)
    sixteen = "2 bytes an element instead of 4" if "16" in dtype else "a narrower dtype"
    return (
        f"{head}. Saved for backward {_arrow(a.memory.saved_bytes, b.memory.saved_bytes)}: the activations "
        f"{_arrow(act_a, act_b)} ({split}: what ran in {dtype} is saved in {sixteen}; norms, softmax and the loss "
        f"run in float32 under autocast and save float32), plus {dtype} copies of the weights autocast keeps for "
        f"backward {_arrow(copies_a, copies_b)}. FLOPs count arithmetic, not bytes: backward "
        f"{_arrow(a.flops.backward, b.flops.backward, _flops)}."
    )


# --- LoRA and frozen weights ----------------------------------------------------------------------------------------


def trained_weights(capture: Capture) -> dict[str, str]:
    """Parameter name -> its AccumulateGrad node, for every parameter that gets a gradient."""
    return {d["param"]["name"]: n for n, d in capture.graph.nodes(data=True) if d["op"] == "AccumulateGrad" and d.get("param")}


def _matmul_flops_by_module(capture: Capture) -> Counter[str]:
    flops: Counter[str] = Counter()
    for _, d in capture.graph.nodes(data=True):
        if d["category"] == "matmul":
            flops[d["module"]] += d["flops"]
    return flops


def matmul_parts(a: Capture, b: Capture) -> dict[str, int] | None:
    """Backward matmul FLOPs A − B split three ways, each from the captures; None when B freezes no weight A trains.

    `weight_gradients`: the gradient matmuls of the weights A trains and B does not, each as big as the forward
    matmul of the module that reads the weight (its autograd consumers in A's graph; a tied weight has two);
    `adapters`: B's matmuls in the modules of the weights B trains and A does not (LoRA's lora_A and lora_B);
    `input_gradients`: the rest of the
    difference, gradients for inputs that nothing before them needs any more (no trainable weight lies before them)."""
    trained_a, trained_b = trained_weights(a), trained_weights(b)
    frozen = [name for name in trained_a if name not in trained_b]
    if not frozen:
        return None
    def matmul_flops(module: str) -> int:
        return sum(f for op, f in a.flops.forward_by_module_op.get(module, {}).items() if op in WEIGHT_MATMULS)

    readers = {name: {a.graph.nodes[n]["module"] for n in a.graph.predecessors(trained_a[name])} for name in frozen}
    weight_gradients = sum(matmul_flops(module) for module in set().union(*readers.values()))
    matmul_weights = sum(  # matrices a matmul reads; a bias in the same addmm is not one
        1 for name, modules in readers.items()
        if len(a.graph.nodes[trained_a[name]]["param"]["shape"]) >= 2 and any(matmul_flops(m) for m in modules)
    )
    by_module_a, by_module_b = _matmul_flops_by_module(a), _matmul_flops_by_module(b)
    new_modules = {name.rpartition(".")[0] for name in trained_b if name not in trained_a}  # the adapters' own
    adapters = sum(flops for module, flops in by_module_b.items() if module in new_modules)
    total_a, total_b = sum(by_module_a.values()), sum(by_module_b.values())
    return {
        "frozen_weights": len(frozen),
        "matmul_weights": matmul_weights,  # of those, the ones a matmul reads (not norms, biases, embedding lookups)
        "a": total_a,
        "b": total_b,
        "weight_gradients": weight_gradients,
        "adapters": adapters,
        "input_gradients": total_a - total_b - weight_gradients + adapters,
    }


def _matmul_words(a: Capture, b: Capture) -> str:
    """The backward matmul FLOPs A → B split into what the weights that stop (or start) training account for."""
    if a.summary.parameter_count >= b.summary.parameter_count:
        parts, sign, verb = matmul_parts(a, b), "−", "no longer train"
    else:  # B trains what A froze: the same parts, the other way round
        parts, sign, verb = matmul_parts(b, a), "+", "start training"
        parts = parts and {**parts, "a": parts["b"], "b": parts["a"]}
    if parts is None:
        return ""
    back = "+" if sign == "−" else "−"
    weights, tensors = parts["matmul_weights"], parts["frozen_weights"]
    terms = [
        f"{sign}{parts['weight_gradients']:,} for the gradient matmuls of the {weights} matmul "
        f"weight{'s' if weights != 1 else ''} among the {tensors} tensor{'s' if tensors != 1 else ''} that {verb} "
        "(each the size of its forward matmul, 2·tokens·in·out)"
    ]
    if parts["input_gradients"]:
        terms.append(f"{sign}{parts['input_gradients']:,} for input gradients "
                     + ("nothing needs any more (no trainable weight before them)" if sign == "−" else
                        "now needed (a trainable weight before them)"))
    if parts["adapters"]:
        terms.append(f"{back}{parts['adapters']:,} for the adapters' own matmuls")
    return f" Backward matmul FLOPs {_arrow(parts['a'], parts['b'], _flops)}: {', '.join(terms)}."


def finetuning_sentence(c: Comparison, field: str, nodes: str, va, vb) -> str:
    """LoRA, its settings or frozen parameters: which parameters get a gradient, and what that changes."""
    a, b = c.a, c.b
    sa, sb, ma, mb = a.summary, b.summary, a.memory, b.memory
    state = ""
    if a.optimizer and b.optimizer:
        state = (f", {OPTIMIZER_NAMES[b.optimizer.optimizer]}'s state (torch.optim's own after one step) "
                 f"{_arrow(a.optimizer.state_bytes, b.optimizer.state_bytes)}")
    matmuls = _matmul_words(a, b)
    return (
        f"{field} {va!r} → {vb!r}: {nodes}; trainable parameters {sa.parameter_count:,} → "
        f"{sb.parameter_count:,} in {sa.parameters} → {sb.parameters} AccumulateGrad nodes (one per trainable "
        f"tensor: a frozen weight gets none), gradients {_arrow(ma.gradient_bytes, mb.gradient_bytes)}{state}: "
        f"gradients and optimizer state only for what trains.{matmuls} What stays: the weights "
        f"({_arrow(ma.parameter_bytes, mb.parameter_bytes)}: the frozen ones are still read) and most activations "
        f"(saved for backward {_arrow(ma.saved_bytes, mb.saved_bytes)}: what goes is what only a frozen weight's "
        "gradient read, such as a frozen linear layer's input or a frozen norm weight's normalised input, and "
        "whatever ops before the first trainable weight kept; the adapters keep their own small inputs)."
    )


# --- torch.compile --------------------------------------------------------------------------------------------------


def compiled_peak_words(capture: Capture) -> str:
    """Why a compiled step's peak can rise while it saves less for backward, read at its peak ("" when the peak is
    not at a compiled node, or no timeline was taken)."""
    from graphviz_core.capture.timeline import KINDS

    timeline = capture.timeline
    if timeline is None or not capture.compiled or not timeline.peak.label.startswith("CompiledFunctionBackward"):
        return ""
    kinds = dict(zip(KINDS, timeline.peak.bytes_by_kind, strict=True))
    return (
        f"the peak, {exact_bytes(timeline.peak_bytes)}, is at {timeline.peak.label}: a compiled region's backward is "
        f"one autograd node, which holds everything its forward saved until it returns and returns every gradient of "
        f"the region at once, so its saved tensors ({exact_bytes(kinds['saved activations'])}) and the gradients "
        f"({exact_bytes(kinds['gradients'])}) are alive together; eager frees each node's saved tensors as soon as "
        "that node has run, so the last layers' activations are gone before the first layers' gradients exist"
    )


def compile_sentence(c: Comparison, nodes: str, alone: bool, va, vb) -> str:
    """Eager against compiled: the compiled nodes, what each side keeps for backward, what is recomputed."""
    compiled = c.b if c.b.compiled else c.a
    summary = compiled.compiled
    if summary is None:
        return f"compile {va} → {vb}: {nodes}."
    regions = summary["regions"]
    recomputed = Counter(op["op"] for region in regions for op in region["recomputed"])
    ops = ", ".join(f"{op} {n}" for op, n in recomputed.most_common(6))
    more = len(recomputed) - 6
    accumulate = compiled.summary.by_op.get("AccumulateGrad", 0)
    outside = compiled.summary.nodes - summary["compiled_nodes"] - accumulate
    breaks = summary["graph_breaks"]
    eager_nodes = (c.a if compiled is c.b else c.b).summary.nodes
    sentence = (
        f"compile {va} → {vb}: {nodes}; the compiled step's {compiled.summary.nodes} nodes are "
        f"{summary['compiled_nodes']} CompiledFunctionBackward (one per compiled region: {summary['graphs']} "
        f"region{'s' if summary['graphs'] != 1 else ''}, {breaks} graph break{'s' if breaks != 1 else ''}), "
        f"{accumulate} AccumulateGrad and {outside} outside the compiled code (the loss)"
        + (f", where eager has {eager_nodes} nodes" if alone else "")
        + f"; the compiled regions' backward FX graphs have {sum(r['backward_nodes'] for r in regions):,} nodes in "
        f"all. Saved for backward eager {exact_bytes(summary['eager_saved_bytes'])} → compiled "
        f"{exact_bytes(summary['saved_bytes'])} ({summary['saved_bytes'] - summary['eager_saved_bytes']:+,} B; "
        f"{exact_bytes(summary['compiled_saved_bytes'])} of it kept by the compiled regions, chosen by inductor's "
        f"min-cut partitioner): the compiled backward recomputes {sum(recomputed.values())} forward ops instead of "
        f"keeping their outputs ({ops}{f', and {more} more ops' if more > 0 else ''})."
    )
    eager = c.a if compiled is c.b else c.b
    why = compiled_peak_words(compiled)
    if why and compiled.memory.peak_bytes > eager.memory.peak_bytes and compiled.memory.saved_bytes < eager.memory.saved_bytes:
        sentence += (f" The peak rises nonetheless ({exact_bytes(eager.memory.peak_bytes)} eager → "
                     f"{exact_bytes(compiled.memory.peak_bytes)} compiled): {why}.")
    if alone:
        sentence += (
            f" Forward FLOPs {_arrow(c.a.flops.forward, c.b.flops.forward, _flops)}, backward "
            f"{_arrow(c.a.flops.backward, c.b.flops.backward, _flops)} (inductor's decompositions, the recomputed "
            "ops included)."
        )
    return sentence


# --- the optimizer --------------------------------------------------------------------------------------------------


def _state_words(capture: Capture) -> str:
    """What the optimizer kept after its step, key by key, each key's bytes per parameter or per tensor where whole."""
    state = capture.optimizer
    name = OPTIMIZER_NAMES[state.optimizer]
    if not state.bytes_by_key:
        return f"{name} keeps no state"
    words = []
    for key, n in state.bytes_by_key.items():
        if state.parameter_count and n % state.parameter_count == 0 and n // state.parameter_count in (2, 4):
            per = f" = {n // state.parameter_count} B × {state.parameter_count:,} parameters"
        elif state.parameter_tensors and n == 4 * state.parameter_tensors:
            per = f" = 4 B × {state.parameter_tensors} tensors"
        else:
            per = ""
        words.append(f"{key} {exact_bytes(n)}{per}")
    return f"{name} keeps " + " + ".join(words)


def optimizer_sentence(c: Comparison, nodes: str, va, vb) -> str:
    """The optimizer runs after backward: the same graph; its state after one torch.optim step, key by key."""
    a, b = c.a, c.b
    if a.optimizer is None or b.optimizer is None:
        return f"optimizer {va} → {vb}: {nodes}; the optimizer runs after backward, so the graph is the same."
    step_a, step_b = training_step_of(a), training_step_of(b)
    return (
        f"optimizer {va} → {vb}: {nodes} — the optimizer runs after backward, so the graph, the bytes saved for "
        f"backward and the FLOPs are the same; its state (torch.optim's own after one step) "
        f"{_arrow(a.optimizer.state_bytes, b.optimizer.state_bytes)}: {_state_words(a)}; {_state_words(b)}. "
        f"The training step's peak {_arrow(step_a.step_peak_bytes, step_b.step_peak_bytes)}."
    )
