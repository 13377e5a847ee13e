"""Measured numbers next to the textbook formulas ("Backprop as a Graph"'s activation memory, "Backpropagating through GPT-2"'s backward
FLOPs), each difference with its reason. Reads only a Capture's graph and config."""

from __future__ import annotations

import re
from dataclasses import dataclass

from graphviz_core.analysis.memory_formulas import (
    as_written_34sbh_bytes,
    korthikanti_layer_bytes,
    layer_bytes_without_dropout,
    llama_layer_bytes,
)
from graphviz_core.capture.device import BYTES_PER
from graphviz_core.capture.flop_formulas import gpt2_article_backward_terms, gpt2_article_backward_total
from graphviz_core.capture.result import Capture

_BLOCK = re.compile(r"^(blocks\.\d+|block)(\.|$)")


@dataclass(frozen=True)
class Comparison:
    """One row: what the formula says, what the capture measured, and why they differ."""

    term: str
    textbook: int | None  # None: the formula has no such term
    measured: int
    note: str


_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")

_SUM_KIND = {
    "residual_add": "residual stream",
    "accumulate_grad": "a parameter used in two places (tied weights)",
    "shape": "pieces of one tensor used separately",
}


def gradient_sum_places(capture: Capture) -> list[tuple[str, int, int]]:
    """Where the engine summed gradients, grouped by receiving op and module (layer numbers as N): (place, how many
    receiving nodes, FLOP). A `Clone` receiving three `Select` gradients is nn.MultiheadAttention's packed
    in-projection (q, k, v cut from one tensor); an `AccumulateGrad` is a tied parameter; an Add, the residual."""
    groups: dict[str, list[int]] = {}
    for _, d in _nodes(capture):
        if d.get("gradient_sum_flops"):
            module = _LAYER_INDEX.sub(".N", d["module"]) or "(top level)"
            kind = _SUM_KIND.get(d["category"], d["category"])
            place = f"{d['op']} in {module}: {kind}"
            if d["param"]:
                place = f"{d['param']['name']}: {kind}"
            groups.setdefault(place, []).append(d["gradient_sum_flops"])
    return sorted(((p, len(f), sum(f)) for p, f in groups.items()), key=lambda r: -r[2])


def describe_gradient_sums(capture: Capture) -> str:
    places = gradient_sum_places(capture)
    if not places:
        return "none"
    return "; ".join(f"{n} × {place} ({flops:,} FLOP)" for place, n, flops in places)


def _nodes(capture: Capture):
    return capture.graph.nodes(data=True)


def _sum(capture: Capture, key: str, where) -> int:
    return sum(d[key] for _, d in _nodes(capture) if where(d))


def _in_block(d: dict, part: str = "") -> bool:
    match = _BLOCK.match(d["module"])
    return bool(match) and (not part or d["module"][match.end(1):].startswith(part))


def frozen_note(capture: Capture, effect: str) -> str:
    """A sentence for rows whose formula assumes every weight trains, when some do not (LoRA, --freeze)."""
    frozen = capture.summary.frozen_parameter_count
    if not frozen:
        return ""
    return f" The formula assumes every weight trains; here {frozen:,} parameters are frozen: {effect}."


FROZEN_MEMORY = ("a frozen linear layer keeps no copy of its input (only its weight's gradient would read it), so "
                 "less is saved wherever no adapter keeps that input instead")
FROZEN_FLOPS = "a frozen weight gets no weight-gradient GEMM, so its layer measures one GEMM, not two"


def memory_per_layer(capture: Capture) -> list[Comparison]:
    """Saved bytes of one transformer layer (mean over the blocks) against Korthikanti's formula."""
    config = capture.config
    formula = config.family.layer_memory_formula
    if formula == "llama":
        return _llama_memory_per_layer(capture)
    if formula != "korthikanti":
        return []
    layers = config.layers
    measured = _sum(capture, "saved_bytes", _in_block) // layers
    no_dropout = layer_bytes_without_dropout(config)
    rows = [
        Comparison("Korthikanti et al. as published (16-bit, with dropout)", korthikanti_layer_bytes(config), measured,
                   "34sbh" + (" + 5as²b" if config.attention == "manual" else "") + " assumes 2-byte activations and "
                   "dropout after attention and MLP; these blocks have no dropout."),
        Comparison("34·s·b·h × bytes per element (a common slip)", as_written_34sbh_bytes(config), measured,
                   f"34sbh is already in bytes (2-byte activations); multiplying by bytes/elem again counts every "
                   f"activation twice: {34 * BYTES_PER[config.dtype]}sbh at {config.dtype}, where "
                   f"{17 * BYTES_PER[config.dtype]}sbh is that formula at this width."),
        Comparison("Korthikanti without dropout, at this dtype", no_dropout, measured,
                   "32sbh" + (" + 2as²b (scores kept by manual attention)" if config.attention == "manual" else
                              " (fused attention keeps no s×s scores)") + "; the measured remainder is per-token "
                   "statistics the formula ignores: LayerNorm mean and rstd"
                   + (", the causal mask" if config.attention == "manual" else ", the attention log-sum-exp")
                   + "." + frozen_note(capture, FROZEN_MEMORY)),
    ]
    if config.checkpoint != "none":
        rows.append(Comparison("checkpointing: inputs held for recompute (whole model)", None,
                               capture.memory.checkpoint_held_bytes,
                               "not saved tensors; the checkpoint keeps them to re-run the forward in backward."))
    return rows


_LLAMA_LAYER = re.compile(r"^model\.layers\.\d+(\.|$)")


def _llama_memory_per_layer(capture: Capture) -> list[Comparison]:
    """Saved bytes of one Llama-style layer (mean over model.layers.*) against the derivation in
    memory.llama_layer_bytes, with and without the float32 RMSNorm upcast, and Korthikanti's GPT-style count."""
    config = capture.config
    # The rotary cos/sin tables are computed once per forward and kept by the first layer's rotary Muls: they are
    # the model's, not a layer's, so they are left out of the per-layer mean.
    in_layers = [d for _, d in _nodes(capture) if _LLAMA_LAYER.match(d["module"])]
    rotary = sum(d["saved_bytes"] for d in in_layers if d["category"] == "position")
    measured = (sum(d["saved_bytes"] for d in in_layers) - rotary) // config.layers
    derived = llama_layer_bytes(config)
    fused_norm = llama_layer_bytes(config, upcast=False)
    s, b, h = config.seq, config.batch, config.hidden
    per_sbh = derived / (s * b * h)
    rows = [
        Comparison(
            "derived for transformers' Llama layer (float32 RMSNorm upcast)",
            derived,
            measured,
            f"{per_sbh:.1f}·s·b·h bytes: two RMSNorms keep a float32 copy of their input, rstd and the normalised "
            "x; "
            + (
                "the fused kernel keeps q, k and v at key-value heads, its output and log-sum-exp; "
                if config.attention == "sdpa"
                else "eager attention keeps the float32 softmax and its copy; "
            )
            + "SwiGLU keeps 4 tensors of the MLP width. The rotary cos/sin tables "
            f"({rotary:,} bytes, once per model) are left out." + frozen_note(capture, FROZEN_MEMORY),
        ),
        Comparison(
            "same layer with a fused RMSNorm (no float32 upcast)",
            fused_norm,
            measured,
            f"a fused RMSNorm keeps its input and rstd only: {derived - fused_norm:,} bytes less per layer "
            f"(2·4·s·b·h); the measured run uses transformers' upcasting RMSNorm, hence the gap.",
        ),
        Comparison(
            "Korthikanti et al. (GPT-style layer, 16-bit, with dropout)",
            korthikanti_layer_bytes(config),
            measured,
            "34·s·b·h counts LayerNorm, full-head attention and a 4h GELU MLP; Llama's SwiGLU is 3.5h wide with "
            "three inputs kept (28·s·b·h at bf16 alone), its key-value heads are fewer, and there is no dropout.",
        ),
    ]
    if config.checkpoint != "none":
        rows.append(
            Comparison(
                "checkpointing: inputs held for recompute (whole model)",
                None,
                capture.memory.checkpoint_held_bytes,
                "not saved tensors; the checkpoint keeps them to re-run the forward in backward.",
            )
        )
    return rows


def backward_flops(capture: Capture) -> list[Comparison]:
    """"Backpropagating through GPT-2"'s backward FLOP terms (gpt2 only) against the FLOPs measured inside the matching nodes."""
    config = capture.config
    if not config.family.gpt2_backward_terms:
        return []
    seed = gpt2_article_backward_terms(config)
    fused = config.attention != "manual"
    core = (seed["layers x query@key"] + seed["layers x attn@value"] + seed["layers x softmax"]
            + seed["layers x scaling"])
    b, s, n_h, d, L = config.batch, config.seq, config.heads, config.head_dim, config.layers

    def attn_core(x: dict) -> bool:
        return _in_block(x, ".attn.core") or x["category"] == "attention"

    rows = [
        Comparison("qkv_proj + attn_out (12bsh² + 4bsh², per layer)", seed["layers x qkv_proj"] + seed["layers x attn_out"],
                   _sum(capture, "flops", lambda x: _in_block(x, ".attn") and x["category"] == "matmul" and not attn_core(x)),
                   "exact: two GEMMs per weight (input and weight gradients); bias sums are not counted."
                   + frozen_note(capture, FROZEN_FLOPS)),
        Comparison("attention core: query@key, scaling, softmax, attn@value", core,
                   _sum(capture, "flops", attn_core),
                   f"the fused kernel recomputes q@kᵀ: 10·b·nh·s²·d = {10 * b * n_h * s * s * d * L:,} for {L} layers, "
                   "and its softmax/scaling arithmetic is not counted separately." if fused else
                   "4 batched GEMMs (8·b·nh·s²·d), softmax 4 and scaling 1 FLOP per score, as the textbook derivation counts them."),
        Comparison("mlp_up + mlp_down (32bsh²)", seed["layers x mlp_up"] + seed["layers x mlp_down"],
                   _sum(capture, "flops", lambda x: _in_block(x, ".mlp") and x["category"] == "matmul"),
                   "exact." + frozen_note(capture, FROZEN_FLOPS)),
        Comparison("gelu (76bsh)", seed["layers x gelu"], _sum(capture, "flops", lambda x: x["category"] == "activation"),
                   "the textbook's 19 FLOPs per element is the count registered for gelu_backward."),
        Comparison("LayerNorms (11bsh each, 2 per layer + final)",
                   seed["layers x pre_attn_ln"] + seed["layers x pre_mlp_ln"] + seed["final_ln"],
                   _sum(capture, "flops", lambda x: x["op"] == "NativeLayerNormBackward0"), "the textbook's 11 per element."),
        Comparison("lm_head (4bshV)", seed["lm_head"], _sum(capture, "flops", lambda x: x["module"] == "lm_head"),
                   "exact."),
        Comparison("cross-entropy: log-softmax (4bsV)", None,
                   _sum(capture, "flops", lambda x: x["op"] == "LogSoftmaxBackward0"),
                   "the textbook derivation counts 4bsV but leaves it out of its total."),
        Comparison("gradient sums where paths meet", None, capture.flops.backward_unattributed,
                   "the engine adds gradients arriving by two paths before the receiving node runs; here: "
                   + describe_gradient_sums(capture) + ". The textbook derivation treats them as free."),
    ]
    if capture.flops.backward_recompute:
        rows.append(Comparison("checkpointing: forward recomputed in backward", None, capture.flops.backward_recompute,
                               "already inside the rows above, in the node that triggered the recompute."))
    rows.append(Comparison("total backward", gpt2_article_backward_total(config),
                           capture.flops.backward,
                           "the textbook closed form vs everything that ran; the rows above account for the gap."))
    return rows
