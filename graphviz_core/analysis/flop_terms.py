""""Backpropagating through GPT-2"'s backward FLOP terms for GPT-2, one row per op, with the FLOPs measured in the matching nodes of a
fused-attention capture and of a manual-attention capture side by side."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from graphviz_core.capture.flop_formulas import gpt2_article_backward_terms
from graphviz_core.capture.result import Capture

Where = Callable[[str, dict], bool]  # (node id, node data) -> belongs to the term
_CORE_TERMS = ("query@key", "softmax", "scaling", "attn@value")


@dataclass(frozen=True)
class TermRow:
    term: str
    formula: str
    textbook_flop: int | None  # None: "Backpropagating through GPT-2" has no such term
    manual_flop: int | None  # None: no node of this capture matches (the work is inside another row)
    fused_flop: int | None
    note: str


def _in(part: str, op: str) -> Where:
    """Nodes of `op` whose module is a block's `part` ("blocks.3.attn.qkv" for part "attn.qkv")."""
    return lambda node, d: d["op"] == op and d["module"].startswith("blocks.") and d["module"].endswith("." + part)


def _core_bmm_roles(capture: Capture) -> dict[str, int]:
    """The two BmmBackward nodes of each block's attention core: numbered from the loss, p·v comes first (0),
    q·kᵀ second (1)."""
    by_module: dict[str, list[str]] = {}
    for node, d in capture.graph.nodes(data=True):
        if d["op"] == "BmmBackward0" and d["module"].endswith(".attn.core"):
            by_module.setdefault(d["module"], []).append(node)
    roles = {}
    for nodes in by_module.values():
        for role, node in enumerate(sorted(nodes, key=lambda n: int(n.rpartition(":")[2]))[:2]):
            roles[node] = role
    return roles


def _sum(capture: Capture, where: Where) -> int | None:
    found = [d["flops"] for node, d in capture.graph.nodes(data=True) if where(node, d)]
    return sum(found) if found else None


def _formulas(roles: dict[str, int]) -> dict[str, tuple[str, Where]]:
    return {
        "pre_attn_ln": ("11·b·s·h", _in("ln_1", "NativeLayerNormBackward0")),
        "qkv_proj": ("12·b·s·h²", _in("attn.qkv", "AddmmBackward0")),
        "query@key": ("4·b·nh·s²·d", lambda n, d: roles.get(n) == 1),
        "softmax": ("4·b·nh·s²", lambda n, d: d["op"] == "SoftmaxBackward0"),
        "scaling": ("b·nh·s²", lambda n, d: d["op"] == "MulBackward0" and d["module"].endswith(".attn.core")),
        "attn@value": ("4·b·nh·s²·d", lambda n, d: roles.get(n) == 0),
        "attn_out": ("4·b·s·h²", _in("attn.proj", "AddmmBackward0")),
        "pre_mlp_ln": ("11·b·s·h", _in("ln_2", "NativeLayerNormBackward0")),
        "mlp_up": ("16·b·s·h²", _in("mlp.fc", "AddmmBackward0")),
        "gelu": ("76·b·s·h", _in("mlp.act", "GeluBackward0")),
        "mlp_down": ("16·b·s·h²", _in("mlp.proj", "AddmmBackward0")),
    }


def terms_both_ways(fused: Capture, manual: Capture) -> list[TermRow]:
    """Every op row of "Backpropagating through GPT-2" (summed over layers), measured with fused and with manual attention.

    Both captures must be GPT-2 models of the same sizes: one with attention "sdpa" or "mha", one "manual".
    """
    for capture, want in ((fused, "fused"), (manual, "manual")):
        if not capture.config.family.gpt2_backward_terms:
            raise ValueError(f"the textbook's per-op terms are for GPT-2 models; the {want} capture is a {capture.config.model}.")
    if (fused.config.attention == "manual") or manual.config.attention != "manual":
        raise ValueError("pass a fused-attention capture (sdpa or mha) first and a manual-attention capture second.")
    # the preset's name, and the device as asked ("auto") rather than as run, don't change a capture (the shared
    # cache keys them away, so a twin may come back under another name)
    if fused.config.replace(attention="manual", preset="", device=fused.device) != manual.config.replace(
        preset="", device=manual.device
    ):
        raise ValueError("the two captures must differ only in attention; pick the same sizes for both.")
    seed = gpt2_article_backward_terms(manual.config)
    config = manual.config
    b, s, n_h, d, layers = config.batch, config.seq, config.heads, config.head_dim, config.layers
    rows = []
    of_manual, of_fused = _formulas(_core_bmm_roles(manual)), _formulas(_core_bmm_roles(fused))
    for name, (formula, where) in of_manual.items():
        core = name in _CORE_TERMS
        manual_flop = _sum(manual, where)
        fused_flop = None if core else _sum(fused, of_fused[name][1])
        note = "inside the fused kernel's one node (row below)" if core else "exact: same node both ways"
        rows.append(
            TermRow(f"{layers} layers × {name}", formula, seed[f"layers x {name}"], manual_flop, fused_flop, note)
        )
    fused_core = _sum(fused, lambda n, x: x["category"] == "attention")
    core_seed = sum(seed[f"layers x {t}"] for t in _CORE_TERMS)
    manual_core = sum(r.manual_flop or 0 for r in rows if r.term.split("× ")[1] in _CORE_TERMS)
    rows.append(
        TermRow(
            f"{layers} layers × attention core, fused",
            "10·b·nh·s²·d (fused)",
            core_seed,
            manual_core,
            fused_core,
            f"the fused backward recomputes q·kᵀ (+4·b·nh·s²·d = {4 * b * n_h * s * s * d * layers:,} FLOP over "
            f"{layers} layers) and its softmax and scaling arithmetic is not counted",
        )
    )
    rows.append(
        TermRow(
            "final_ln",
            "11·b·s·h",
            seed["final_ln"],
            *(
                _sum(c, lambda n, x: x["module"] == "ln_f" and x["op"] == "NativeLayerNormBackward0")
                for c in (manual, fused)
            ),
            "exact: same node both ways",
        )
    )
    rows.append(
        TermRow(
            "lm_head",
            "4·b·s·h·V",
            seed["lm_head"],
            *(_sum(c, lambda n, x: x["module"] == "lm_head") for c in (manual, fused)),
            "exact: input and weight gradients of the tied head",
        )
    )
    rows.append(
        TermRow(
            "cross-entropy (log-softmax)",
            "4·b·s·V",
            seed["cross_entropy (not in the article's total)"],
            *(_sum(c, lambda n, x: x["op"] == "LogSoftmaxBackward0") for c in (manual, fused)),
            "the textbook derivation counts it but leaves it out of its total",
        )
    )
    rows.append(
        TermRow(
            "gradient sums where paths meet",
            "—",
            None,
            manual.flops.backward_unattributed,
            fused.flops.backward_unattributed,
            "the engine adds gradients arriving by two paths; not a node",
        )
    )
    return rows
