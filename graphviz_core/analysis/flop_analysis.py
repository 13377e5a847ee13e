"""Where a capture's FLOPs and time went: per layer, per op family, per node, and against 6·N·tokens.

Pure functions of one `Capture`; they return numbers in frozen dataclasses (units in the field names),
and `graphviz_core.units` turns them into text.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import Counter
from dataclasses import dataclass

from graphviz_core.capture.result import Capture
from graphviz_core.graph.categories import category_of

BATCHED_MATMUL = "batched matmul (bmm: q·kᵀ and p·v when attention is spelled out; a mixture of experts' experts)"
GROUPED_MATMUL = "grouped matmul (a mixture of experts' experts: one GEMM per expert's tokens)"
# Aten op (as the capture records it, "aten.mm") -> the family whose backward/forward ratio we report.
FAMILIES: dict[str, str] = {
    "aten.mm": "linear layers (mm, addmm)",
    "aten.addmm": "linear layers (mm, addmm)",
    "aten.bmm": BATCHED_MATMUL,
    "aten.baddbmm": BATCHED_MATMUL,
    "aten._grouped_mm": GROUPED_MATMUL,
    "aten.convolution": "convolution",
    "aten.convolution_backward": "convolution",
    "aten.add": "elementwise (add, sub, mul, div)",
    "aten.add_": "elementwise (add, sub, mul, div)",
    "aten.sub": "elementwise (add, sub, mul, div)",
    "aten.sub_": "elementwise (add, sub, mul, div)",
    "aten.mul": "elementwise (add, sub, mul, div)",
    "aten.mul_": "elementwise (add, sub, mul, div)",
    "aten.div": "elementwise (add, sub, mul, div)",
    "aten.div_": "elementwise (add, sub, mul, div)",
    "aten.gelu_backward": "GELU",
    "aten.native_layer_norm_backward": "LayerNorm",
    "aten._softmax_backward_data": "softmax",
    "aten._log_softmax_backward_data": "log-softmax (loss)",
}
FUSED_ATTENTION = "fused attention (one kernel: q·kᵀ, softmax, p·v)"
# What each family's backward/forward ratio is expected to be, and why.
EXPECTED: dict[str, tuple[float | None, str]] = {
    "linear layers (mm, addmm)": (2.0, "y = x·W needs dx = dy·Wᵀ and dW = xᵀ·dy: two matmuls of the forward's size"),
    GROUPED_MATMUL: (2.0, "an input gradient and a weight gradient per expert, each a GEMM of the forward's size"),
    BATCHED_MATMUL: (
        2.0,
        "two matmuls per forward matmul, as a linear layer",
    ),
    FUSED_ATTENTION: (
        2.5,
        "forward 2 matmuls (q·kᵀ, p·v); backward 5: it recomputes q·kᵀ (nothing s×s was kept), then dV, dP, dQ, dK. "
        "Dense count: a causal kernel skips wholly masked key blocks, so it does less (about half at long "
        "sequences)",
    ),
    "convolution": (2.0, "input gradient and weight gradient, each a convolution of the forward's size"),
    "elementwise (add, sub, mul, div)": (
        1.0,
        "one op per element each way; backward adds are the engine summing gradients where paths meet",
    ),
    "GELU": (None, "forward not counted (no forward formula); backward 19 FLOP/element (the textbook's count)"),
    "LayerNorm": (None, "forward not counted (no forward formula); backward 11 FLOP/element (the textbook's count)"),
    "softmax": (None, "forward not counted (no forward formula); backward 4 FLOP/element (the textbook's count)"),
    "log-softmax (loss)": (None, "forward not counted (no forward formula); backward 4 FLOP/element (the textbook's count)"),
}
FOLKLORE_RATIO = 2.0
# Categories whose backward does no arithmetic: views and reshapes, dtype copies, storing a gradient, and a residual
# add's backward (it hands the same gradient to both inputs). A 0 there is the truth; a 0 elsewhere means the ops
# ran have no FLOP formula (torch's flop_counter registers none for silu, relu, batch norm, embedding backward...).
NO_ARITHMETIC = frozenset({"shape", "conversion", "cast", "accumulate_grad", "residual_add"})
NOT_COUNTED_NOTE = "not counted: these ops have no FLOP formula in torch's flop_counter or ours"
# Op families whose backward op has a FLOP formula but whose forward op has none (torch's flop_counter registers
# none for gelu, native_layer_norm, softmax, log_softmax): their backward is counted, their forward is not.
FORWARD_NOT_COUNTED = frozenset({"GELU", "LayerNorm", "softmax", "log-softmax (loss)"})


def uncounted_categories(capture: Capture) -> list[str]:
    """Categories present in the graph whose backward counted 0 FLOPs though they do arithmetic (their ops have no
    FLOP formula), sorted by name: the UI says "not counted" there, not "0 FLOP"."""
    counted = capture.flops.backward_by_category
    return sorted(c for c, n in capture.summary.by_category.items()
                  if n and not counted.get(c) and c not in NO_ARITHMETIC)


def norm_and_activation_names(capture: Capture) -> list[str]:
    """The normalisations and activations this model ran, by name ("RMSNorm", "SiLU"), from its ops and family."""
    ops = capture.summary.by_op
    names = [
        ("LayerNorm", any("LayerNorm" in op for op in ops)),
        ("RMSNorm", capture.config.family.rms_norm or any("RmsNorm" in op for op in ops)),
        ("BatchNorm", any("BatchNorm" in op for op in ops)),
        ("GELU", any(op.startswith("Gelu") for op in ops)),
        ("SiLU", any(op.startswith("Silu") for op in ops)),
        ("ReLU", any(op.startswith("Relu") for op in ops)),
        ("softmax", any(op.startswith("Softmax") for op in ops)),
    ]
    return [name for name, ran in names if ran]


def family_of(op: str) -> str:
    if "scaled_dot_product" in op or "flash_attention" in op or "efficient_attention" in op:
        return FUSED_ATTENTION
    return FAMILIES.get(op, f"other ({op})")


LOSS_AND_GLUE = "(loss and glue)"


@functools.lru_cache(maxsize=65536)  # asked once per node; an 80-layer model has ~1,000 modules for ~10,000 nodes
def layer_of(module: str) -> str:
    """The layer a module belongs to, the one grouping of the FLOPs, memory and compare panels: its path up to the
    first numeric part ("model.layers.3.mlp" -> "model.layers.3", "resnet.encoder.stages.0.layers.1" ->
    "resnet.encoder.stages.0"), else its first two parts, so a Hugging Face wrapper's embeddings, final norm and
    pooler stay apart ("model.embed_tokens", "model.norm", "bert.embeddings", "lm_head"); "" (ops outside every
    module: the loss) -> "(loss and glue)"."""
    if not module:
        return LOSS_AND_GLUE
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:2])


def node_parts(node: str, data: dict) -> list[tuple[str, float, int, int]]:
    """(module, place, saved bytes, backward FLOPs) of one node of the graph, one tuple per module it holds work of.

    An eager node is one module's. A compiled region's node (`CompiledFunctionBackward`) holds the saved tensors and
    the backward of every module in its region: it comes split by module, in the order the forward ran them
    (graphviz_core.capture.compiled's `by_module`). `place` orders them as node numbers do (numbered from the loss:
    the later in the forward, the smaller): the node's number plus a fraction below 1 that falls along the forward."""
    number = int(node.rpartition(":")[2])
    split = (data.get("compiled") or {}).get("by_module")
    if not split:
        return [(data["module"], number, data["saved_bytes"], data["flops"])]
    count = len(split)
    return [(row["module"], number + (count - 1 - i) / count, row["saved_bytes"], row["flops"])
            for i, row in enumerate(split)]


def layers_in_forward_order(capture: Capture) -> list[str]:
    """Every layer of the graph in the order the forward ran them (embeddings, layers 0..N-1, final norm, head),
    the loss and glue last. Node ids are numbered from the loss, so a layer's smallest number is where backward
    first reaches it: the later a layer ran in the forward, the sooner backward reaches it."""
    first: dict[str, float] = {}
    for node, data in capture.graph.nodes(data=True):
        for module, place, _, _ in node_parts(node, data):
            layer = layer_of(module)
            first[layer] = min(first.get(layer, place), place)
    return sorted(first, key=lambda name: (name == LOSS_AND_GLUE, -first[name], _natural(name)))


@dataclass(frozen=True)
class LayerFlops:
    layer: str
    forward_flop: int
    backward_flop: int


def flops_per_layer(capture: Capture) -> list[LayerFlops]:
    """Forward and backward FLOPs per layer, in forward order (the loss last)."""
    forward: Counter[str] = Counter()
    for module, flops in capture.flops.forward_by_module.items():
        forward[layer_of(module)] += flops
    backward: Counter[str] = Counter()
    # Node ids are numbered from the loss (pre-order), so the largest number of a layer is nearest the input.
    depth: dict[str, float] = {}
    for node, data in capture.graph.nodes(data=True):
        for module, place, _, flops in node_parts(node, data):
            layer = layer_of(module)
            backward[layer] += flops
            depth[layer] = max(depth.get(layer, -1), place)
    sums = "(gradient sums between nodes)"
    if capture.flops.backward_unattributed:
        backward[sums] += capture.flops.backward_unattributed
    layers = set(forward) | {k for k, v in backward.items() if v}

    def place(name: str) -> tuple:
        # layers backward reaches, nearest the loss first; then modules with forward FLOPs only (position and mask
        # bookkeeping, rotary tables: no node of the graph is theirs); then the loss and glue, then the gradient sums
        group = 3 if name == sums else 2 if name == LOSS_AND_GLUE else 0 if name in depth else 1
        return group, -depth.get(name, -1), _natural(name)

    order = sorted(layers, key=place)
    return [LayerFlops(name, forward[name], backward[name]) for name in order]


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


@dataclass(frozen=True)
class FamilyRatio:
    family: str
    forward_flop: int | None  # None where the forward ran ops with no FLOP formula ("not counted", not 0)
    backward_flop: int
    ratio: float | None  # backward / forward; None where the forward is not counted
    expected_ratio: float | None
    why: str


def _forward_counted(family: str, forward_flop: int) -> bool:
    # an unknown family ("other (aten.x)") with no forward op counted: its forward, if any, had no formula
    return family not in FORWARD_NOT_COUNTED and (bool(forward_flop) or not family.startswith("other ("))


def ratios_by_family(capture: Capture) -> list[FamilyRatio]:
    """Backward/forward FLOPs per op family, measured from the aten ops each pass ran (largest first)."""
    forward: Counter[str] = Counter()
    backward: Counter[str] = Counter()
    for op, flops in capture.flops.forward_by_op.items():
        forward[family_of(op)] += flops
    for op, flops in capture.flops.backward_by_op.items():
        backward[family_of(op)] += flops
    rows = []
    for family in sorted(set(forward) | set(backward), key=lambda f: -(forward[f] + backward[f])):
        expected, why = EXPECTED.get(family, (None, "no stated expectation"))
        counted = _forward_counted(family, forward[family])
        ratio = backward[family] / forward[family] if counted and forward[family] else None
        rows.append(FamilyRatio(family, forward[family] if counted else None, backward[family], ratio, expected, why))
    return rows


@dataclass(frozen=True)
class OverallRatio:
    """Backward / forward over the op families counted both ways, and what that leaves out."""

    forward_flop: int  # every forward op counted (ops with no forward formula add nothing here)
    backward_flop: int  # every backward op counted, less the left-out families'
    ratio: float | None  # backward_flop / forward_flop
    left_out_families: tuple[str, ...]  # backward counted, forward not (no forward formula), largest first
    left_out_backward_flop: int
    all_ops_ratio: float | None  # every counted backward / every counted forward: overstated by the left-out ops


def overall_ratio(capture: Capture) -> OverallRatio:
    """Dividing every counted backward by every counted forward puts GELU's, LayerNorm's and the loss's backward
    over a forward that leaves them out; this ratio takes them out of the backward too, and says which."""
    rows = ratios_by_family(capture)
    left_out = [r for r in rows if r.forward_flop is None and r.backward_flop]
    left_out_backward = sum(r.backward_flop for r in left_out)
    forward, backward = capture.flops.forward, capture.flops.backward
    return OverallRatio(
        forward,
        backward - left_out_backward,
        (backward - left_out_backward) / forward if forward else None,
        tuple(r.family for r in left_out),
        left_out_backward,
        backward / forward if forward else None,
    )


@dataclass(frozen=True)
class RuleTerm:
    term: str
    flop: int


@dataclass(frozen=True)
class Experts:
    """A mixture of experts' share of the rule of thumb: its expert weights and what their matmuls measured."""

    count: int  # experts per layer
    per_token: int  # experts each token is routed to
    parameters: int  # scalars in every expert's weights
    idle_parameters: int  # of those, the ones a given token does not use: parameters × (count - per_token) / count
    flop: int  # the experts' matmuls (grouped or batched), forward + backward


@dataclass(frozen=True)
class RuleOfThumb:
    """Measured forward + backward next to 6·N·tokens + the attention term, and the gap term by term."""

    tokens: int
    parameters: int
    six_n_tokens_flop: int
    attention_flop: int  # 12·L·b·s²·h: q·kᵀ and p·v, dense, forward ×3 for training
    rule_flop: int
    measured_flop: int
    gap: tuple[RuleTerm, ...]  # rule + sum(gap) == measured, exactly
    not_applicable: str | None = None  # why the rule says nothing about this model (a convolutional network)
    experts: Experts | None = None  # a mixture of experts: its idle and active expert weights


def _in_experts(name: str) -> bool:
    return name.endswith(".experts") or ".experts." in name


def experts_of(capture: Capture) -> Experts | None:
    """None for a model without routed experts. Mixtral's experts hold their weights stacked, one (experts, ...)
    tensor per projection, and run as one grouped matmul (or bmm over each token's gathered weights where torch has
    no grouped matmul), so their FLOPs are those matmuls' inside an `experts` module: forward from the capture's
    per-module counts, backward from those nodes."""
    config = capture.config
    if not config.experts:
        return None
    parameters = sum(
        math.prod(d["param"]["shape"]) for _, d in capture.graph.nodes(data=True)
        if d["param"] and _in_experts(d["param"]["name"])
    )
    forward = sum(
        flops for module, ops in capture.flops.forward_by_module_op.items() if _in_experts(module)
        for op, flops in ops.items() if FAMILIES.get(op) in (BATCHED_MATMUL, GROUPED_MATMUL)
    )
    backward = sum(
        d["flops"] for _, d in capture.graph.nodes(data=True)
        if _in_experts(d["module"]) and d["op"] in ("BmmBackward0", "BaddbmmBackward0", "GroupedMmBackward0")
    )
    idle = parameters * (config.experts - config.experts_per_token) // config.experts
    return Experts(config.experts, config.experts_per_token, parameters, idle, forward + backward)


CONV_RULE = (
    "6·N·tokens does not apply to a convolutional network: a convolution applies each weight at every output "
    "pixel, so its FLOPs grow with the image, not with the parameter count (the per-layer charts above are measured)."
)


def rule_of_thumb(capture: Capture) -> RuleOfThumb:
    config = capture.config
    tokens = config.batch * config.tokens  # ViT: patches + class token per image, not seq
    frozen = capture.summary.frozen_parameter_count  # LoRA's base weights, --freeze: forward and input grads only
    n = capture.summary.parameter_count + frozen
    six_n = 6 * n * tokens
    has_attention = config.family.has_attention
    attention = 12 * config.layers * config.batch * config.tokens**2 * config.hidden if has_attention else 0
    f, b = capture.flops.forward_by_op, capture.flops.backward_by_op

    def total(ops: dict[str, int], family: str) -> int:
        return sum(v for op, v in ops.items() if family_of(op) == family)

    linear = "linear layers (mm, addmm)"
    linear_forward, linear_backward = total(f, linear), total(b, linear)
    experts = experts_of(capture)
    # bmm is attention's q·kᵀ and p·v, except where experts run as bmm (torch without grouped matmuls)
    experts_bmm = experts.flop - total(f, GROUPED_MATMUL) - total(b, GROUPED_MATMUL) if experts else 0
    attention_measured = sum(total(f, fam) + total(b, fam) for fam in (FUSED_ATTENTION, BATCHED_MATMUL)) - experts_bmm
    matmul_params = linear_forward // (2 * tokens) if tokens else 0
    measured = capture.flops.forward + capture.flops.backward
    expert_params = experts.parameters if experts else 0
    gap = [
        RuleTerm(
            f"{n - matmul_params - expert_params:,} of the {n:,} parameters do no matrix multiply (embedding lookups, "
            f"biases, norm gains; a tied table counts once): 6 × that × tokens is never spent",
            -6 * (n - matmul_params - expert_params) * tokens,
        ),
    ]
    if experts:
        gap += [
            RuleTerm(
                f"{experts.idle_parameters:,} of the {expert_params:,} expert parameters see no given token: each is "
                f"routed to {experts.per_token} of {experts.count} experts, so 6 × that × tokens is never spent",
                -6 * experts.idle_parameters * tokens,
            ),
            RuleTerm(
                "the experts' matmuls vs 6 × the active expert parameters × tokens",
                experts.flop - 6 * (expert_params - experts.idle_parameters) * tokens,
            ),
        ]
    gap += [
        RuleTerm(
            "linear layers' backward is not exactly 2× their forward (e.g. no gradient for an input that needs none"
            + (f"; the {frozen:,} frozen parameters get no weight gradient" if frozen else "") + ")",
            linear_backward - 2 * linear_forward,
        ),
        RuleTerm(
            "attention measured vs 12·L·b·s²·h: the fused kernel recomputes q·kᵀ in backward (2.5× forward, not 2×)",
            attention_measured - attention,
        ),
    ]
    other = (measured - (6 * matmul_params * tokens + (linear_backward - 2 * linear_forward)) - attention_measured
             - (experts.flop if experts else 0))
    ran = ", ".join([*norm_and_activation_names(capture), "loss"])
    gap.append(RuleTerm(f"{ran} and elementwise ops (the rule counts only matmuls)", other))
    # A rounding remainder from matmul_params' integer division keeps the sum exact.
    remainder = measured - (six_n + attention + sum(t.flop for t in gap))
    if remainder:
        gap.append(
            RuleTerm("linear FLOPs not a whole multiple of 2·tokens (rounding of the parameter count)", remainder)
        )
    return RuleOfThumb(tokens, n, six_n, attention, six_n + attention, measured, tuple(gap),
                       CONV_RULE if config.family.convolutional else None, experts)


@dataclass(frozen=True)
class NodeCost:
    node: str
    op: str
    module: str
    category: str
    flop: int | None  # None where its ops have no FLOP formula ("not counted"); 0 only where it does no arithmetic
    time_s: float | None  # as measured, instrumentation included
    net_time_s: float | None  # time_s minus the per-node instrumentation overhead, floored at 0
    flop_per_s: float | None  # flop / net_time_s; None when the node ran within the overhead (net time 0)
    bytes_moved: int  # gradients read and written + tensors saved for it (read back), parameters included
    intensity_flop_per_byte: float | None


def instrumentation_overhead_s(capture: Capture) -> float | None:
    """Per-node overhead of the timing hooks and FLOP counter, measured in this run: the median time of the
    shape nodes (view, transpose, expand…), which do no arithmetic, so their time is almost all overhead."""
    times = [
        d["time_s"] for _, d in capture.graph.nodes(data=True) if d["category"] == "shape" and d["time_s"] is not None
    ]
    return statistics.median(times) if times else None


def flop_counted(category: str, op: str, flop: int) -> bool:
    """Whether a node's FLOP count means what it says: any FLOPs were counted, or it does no arithmetic (its
    category, or its op alone, is in NO_ARITHMETIC: a view, a copy, an AddBackward0 handing one gradient to both
    inputs). A 0 elsewhere (EmbeddingBackward0, SiluBackward0) means its ops have no FLOP formula."""
    return bool(flop) or category in NO_ARITHMETIC or category_of(op) in NO_ARITHMETIC


def node_costs(capture: Capture) -> list[NodeCost]:
    overhead = instrumentation_overhead_s(capture) or 0.0
    rows = []
    for node, d in capture.graph.nodes(data=True):
        moved = d.get("grad_io_bytes", 0) + sum(s["bytes"] for s in d["saved"])
        time_s = d["time_s"]
        net = None if time_s is None else max(time_s - overhead, 0.0)
        rows.append(
            NodeCost(
                node,
                d["op"],
                d["module"],
                d["category"],
                d["flops"] if flop_counted(d["category"], d["op"], d["flops"]) else None,
                time_s,
                net,
                d["flops"] / net if net and d["flops"] else None,
                moved,
                d["flops"] / moved if moved and d["flops"] else None,
            )
        )
    return rows


def top_nodes(capture: Capture, by: str, n: int = 10) -> list[NodeCost]:
    """The n nodes with the most FLOPs (by="flop") or time (by="time_s"), largest first."""
    if by not in ("flop", "time_s"):
        raise ValueError(f"top nodes by {by!r}: choose 'flop' or 'time_s'.")
    rows = [r for r in node_costs(capture) if getattr(r, by)]
    return sorted(rows, key=lambda r: -getattr(r, by))[:n]
