"""One layer's activations on one rank under context or sequence parallelism: measured, counted by hand, and beside
Korthikanti et al.'s formula ("Reducing Activation Recomputation in Large Transformer Models"), the differences
named with their bytes.

Measured: the activations alive when forward ends (PerRank.forward_end_activation_bytes) of the same layout on a
2-layer and a 1-layer copy of the model; the difference is one layer (embeddings, final norm, head and logits
cancel). Counted: graphviz_core.analysis.memory_formulas.llama_layer_bytes_split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from graphviz_core.analysis.memory_formulas import korthikanti_split_layer_bytes, llama_layer_bytes_split
from graphviz_core.capture.device import BYTES_PER
from graphviz_core.config import ModelConfig
from graphviz_core.parallel.context import kv_exchange_bytes
from graphviz_core.parallel.settings import ParallelConfig


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one transformer layer keeps for backward on rank 0."""

    measured_bytes: int  # 2-layer minus 1-layer model, same layout
    count_bytes: dict[str, int]  # the hand count by part (norms, attention, mlp, gathered_inputs, ring_output_copy)
    korthikanti_bytes: dict[str, int] | None  # as published (16-bit), by part; None without tensor parallelism
    korthikanti_formula: str
    differences: tuple[str, ...]  # why the measurement and the formula differ, each with its bytes
    kv_exchange: dict | None  # context parallel: the ring's key/value traffic per layer, recorded and by formula

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["count_total_bytes"] = sum(self.count_bytes.values())
        out["korthikanti_total_bytes"] = sum(self.korthikanti_bytes.values()) if self.korthikanti_bytes else None
        out["differences"] = list(self.differences)
        return out


def layer_activations(
    config: ModelConfig, parallel: ParallelConfig, measured_bytes: int, collectives=()
) -> LayerActivations:
    """`measured_bytes` (one layer under `parallel`, from simulations of 1- and 2-layer copies) beside the count and
    the formula; `collectives` are the full simulation's, whose ring-attention transfers are summed per layer."""
    tp, cp, sp = parallel.tp, parallel.cp, parallel.sequence_parallel
    count = llama_layer_bytes_split(config, tp=tp, cp=cp, sequence_parallel=sp)
    # Korthikanti et al. have no context parallelism: their layer at the s/C tokens this rank holds.
    local = config.replace(seq=config.seq // cp)
    korthikanti = korthikanti_split_layer_bytes(local, tp=tp, sequence_parallel=sp) if tp > 1 else None
    formula = ""
    if korthikanti is not None:
        formula = ("s·b·h/t·(34 + 5·a·s/h)" if sp else "s·b·h·(10 + 24/t + 5·a·s/(h·t))") + f", t = {tp}, 16-bit"
        if cp > 1:
            formula += f", s = {local.seq} tokens on this rank (sequence / context parallel {cp})"
    return LayerActivations(
        measured_bytes=measured_bytes,
        count_bytes=count,
        korthikanti_bytes=korthikanti,
        korthikanti_formula=formula,
        differences=_differences(local, parallel, count) if korthikanti is not None else (),
        kv_exchange=_kv_exchange(config, parallel, collectives) if cp > 1 else None,
    )


def _kv_exchange(config: ModelConfig, parallel: ParallelConfig, collectives) -> dict:
    """The ring's transfers (the context group's collectives that no FSDP hook issued), per layer."""
    ring = [c for c in collectives if c.group == "cp" and c.parameters_of is None]
    sent = {"forward": 0, "backward": 0}
    for c in ring:
        sent[c.phase] = sent.get(c.phase, 0) + c.traffic_bytes
    h, a = config.hidden, config.heads
    kv_width = (config.kv_heads or a) * (h // a) // parallel.tp  # tensor parallel: this rank's key/value heads
    formula = kv_exchange_bytes(config.batch, config.seq, kv_width, BYTES_PER[config.dtype], parallel.cp)
    return {
        "recorded_forward_bytes": sent["forward"] // config.layers,
        "recorded_backward_bytes": sent["backward"] // config.layers,
        "formula_forward_bytes": formula["forward_bytes"],
        "formula_backward_bytes": formula["backward_bytes"],
        "collectives_per_layer": len(ring) // config.layers,
        "formula": "forward: all-gather of k and v, (C-1)·2·b·(s/C)·kv·e sent (kv: key/value width on this rank, "
        "/t under tensor parallel); backward: the same all-gather, then C all-to-all passes of their "
        "float32 gradients, C·2·b·(s/C)·kv·4",
    }


def _differences(config: ModelConfig, parallel: ParallelConfig, count: dict[str, int]) -> tuple[str, ...]:
    """Why this model's layer differs from Korthikanti's GPT layer, each cause with its bytes at 16 bits (the formula's
    unit) or at the model's dtype (this count's)."""
    s, b, h, a, t = config.seq, config.batch, config.hidden, config.heads, parallel.tp
    e = BYTES_PER[config.dtype]
    inter = config.intermediate or 4 * h
    kv = config.kv_heads or a
    notes = [
        f"Fused attention (sdpa) keeps no a·s² score matrix: the formula's 5·a·s²·b/t = {5 * a * s * s * b // t:,} B "
        "(scores, their dropout mask and output) is absent; the kernel keeps its output and a float32 log-sum-exp "
        f"per head and token ({4 * a * s * b // t:,} B here).",
        f"No dropout (p = 0): the formula's two s·b·h dropout masks after attention and MLP are absent "
        f"({2 * s * b * h // (t if parallel.sequence_parallel else 1):,} B).",
        f"Activations are {config.dtype}, {e} bytes per element; the formula counts 2.",
        f"SwiGLU keeps four tensors of width {inter} (gate, SiLU, up and their product: 4·e·s·b·{inter}/t = "
        f"{count['mlp']:,} B) where the formula's GELU MLP keeps 16·s·b·h/t at width 4h.",
        "RMSNorm as transformers writes it keeps a float32 copy of its input, the normalised x and 1/rms per token "
        f"(norms: {count['norms']:,} B) where the formula keeps each LayerNorm's 16-bit input.",
    ]
    if kv != a:
        notes.append(f"Grouped-query attention: keys and values at {kv} of {a} heads.")
    if parallel.sequence_parallel:
        notes.append(
            f"torch keeps the all-gathered input of the attention's and MLP's column-split projections whole "
            f"(2·e·s·b·h = {count['gathered_inputs']:,} B): its matmul saves the tensor it multiplied, where Megatron "
            "keeps the 1/t shard and gathers it again in backward."
        )
    return tuple(notes)
