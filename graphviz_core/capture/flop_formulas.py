"""FLOP formulas: the registry the capture's dispatch mode looks up, and "Backpropagating through GPT-2"'s textbook backward terms.

Measured FLOPs come from `torch.utils.flop_counter`'s formula registry (matmuls, convolutions, fused
attention on CUDA), extended here with formulas for what it misses:

- the CPU fused attention (`_scaled_dot_product_flash_attention_for_cpu` and its backward), which
  flop_counter counts as 0 — so CPU, CUDA and meta captures count the same work;
- "Backpropagating through GPT-2"'s per-element counts for the backward kernels it derives (GELU 19, LayerNorm 11, softmax and
  log-softmax 4 FLOPs per element);
- one FLOP per output element for elementwise arithmetic (add, sub, mul, div).

Reductions (the `sum` that makes a bias gradient), copies, views and index work count 0, as in
flop_counter. All formulas are pure functions of shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils import flop_counter

from graphviz_core.config import ModelConfig

aten = torch.ops.aten

Formula = Callable[..., int]


def _shape(x: object) -> object:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else x


def _on_shapes(formula: Formula) -> Formula:
    """Call `formula` with every tensor argument (and `out_val`) replaced by its shape."""

    def wrapped(*args, out_val=None, **kwargs):
        out = tuple(_shape(o) for o in out_val) if isinstance(out_val, (tuple, list)) else _shape(out_val)
        return formula(*(_shape(a) for a in args), out_val=out, **{k: _shape(v) for k, v in kwargs.items()})

    return wrapped


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _bmm(batch: int, m: int, k: int, n: int) -> int:
    return 2 * batch * m * k * n  # flop_counter's count: m·n outputs, k multiply-adds each


def matmul_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """mm and bmm: 2·m·k·n (times the batch), as flop_counter's mm_flop / bmm_flop."""
    return _bmm(a[0] if len(a) == 3 else 1, a[-2], a[-1], b[-1])


def matmul_plus_flops(bias, a, b, *args, out_val=None, **kwargs) -> int:
    """addmm and baddbmm: the product's FLOPs, the bias add not counted, as flop_counter's addmm_flop."""
    return matmul_flops(a, b)


def grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """`_grouped_mm` (a mixture of experts' expert GEMMs), by its layouts (offs splits the 2-D side into groups):
    - a (rows, k), b (groups, k, n): each row meets one group's matrix: 2·rows·k·n (forward, input gradient);
    - a (m, k), b (k, n), k split by offs, out (groups, m, n): each group sums its share of k: 2·m·k·n (the weight
      gradient: m, n the weight's dims, k the routed rows);
    - a (groups, m, k), b (k, n), n split by offs, out (m, n): 2·m·k·n;
    - a (groups, m, k), b (groups, k, n): a bmm, 2·groups·m·k·n."""
    if len(a) == 3:
        return _bmm(a[0], a[1], a[2], b[2]) if len(b) == 3 else 2 * a[1] * a[2] * b[1]
    return 2 * a[0] * a[1] * b[-1]


def sdpa_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    """Fused attention forward (any kernel): q@kᵀ and p@v, 2 GEMMs = 4·b·nh·s²·d (dense count), as flop_counter's
    sdpa_flop_count; grouped key/value heads are broadcast to the query's heads."""
    b, h, s_q, d = query
    s_k, d_v = key[2], value[3]
    return _bmm(b * h, s_q, d, s_k) + _bmm(b * h, s_q, s_k, d_v)


def sdpa_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    """Fused attention backward: it recomputes q@kᵀ, then dV, dP, dQ, dK: 5 GEMMs = 10·b·nh·s²·d, as flop_counter's
    sdpa_backward_flop_count.

    A dense count: the causal kernel skips key blocks that are wholly masked, so the arithmetic it really does is
    a little over half of this for long sequences.
    """
    b, h, s_q, d = query
    s_k, d_v = key[2], value[3]
    return (_bmm(b * h, s_q, d, s_k) + _bmm(b * h, s_q, d_v, s_k) + _bmm(b * h, s_k, s_q, d_v)
            + _bmm(b * h, s_q, s_k, d) + _bmm(b * h, d, s_q, s_k))


def per_element(count: int) -> Formula:
    """A formula of `count` FLOPs per element of the op's first output."""

    def formula(*args, out_val=None, **kwargs) -> int:
        out = out_val[0] if isinstance(out_val, tuple) and out_val and isinstance(out_val[0], tuple) else out_val
        return count * _numel(out) if isinstance(out, tuple) else 0

    return formula


def layer_norm_backward_flops(grad_out, *args, out_val=None, **kwargs) -> int:
    """"Backpropagating through GPT-2": 8 FLOPs/element for the input gradient, 2 for gamma's, 1 for beta's (11·b·s·h in all)."""
    output_mask = args[-1] if args and isinstance(args[-1], (list, tuple)) else kwargs.get("output_mask", (1, 1, 1))
    per_elem = 8 * bool(output_mask[0]) + 2 * bool(output_mask[1]) + 1 * bool(output_mask[2])
    return per_elem * _numel(grad_out)


# The matmul and fused-attention formulas below replace flop_counter's own for the same ops with the same counts
# (tests/test_flops.py checks them against its registry): flop_counter's call each other through their pytree
# wrappers (addmm_flop -> mm_flop, sdpa -> bmm_flop), a cost paid on every matmul the capture counts.
_EXTRA: dict[object, Formula] = {
    aten.mm: matmul_flops,
    aten.bmm: matmul_flops,
    aten.addmm: matmul_plus_flops,
    **({aten._grouped_mm: grouped_mm_flops} if hasattr(aten, "_grouped_mm") else {}),
    aten.baddbmm: matmul_plus_flops,
    **{op: sdpa_flops for op in (aten._scaled_dot_product_flash_attention_for_cpu,
                                 aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention,
                                 aten._scaled_dot_product_cudnn_attention)},
    **{op: sdpa_backward_flops for op in (aten._scaled_dot_product_flash_attention_for_cpu_backward,
                                          aten._scaled_dot_product_efficient_attention_backward,
                                          aten._scaled_dot_product_flash_attention_backward,
                                          aten._scaled_dot_product_cudnn_attention_backward)},
    aten.gelu_backward: per_element(19),  # "Backpropagating through GPT-2": 76·b·s·h over a (b, s, 4h) tensor
    aten.native_layer_norm_backward: layer_norm_backward_flops,
    aten._softmax_backward_data: per_element(4),  # "Backpropagating through GPT-2", softmax: 4·b·nh·s²
    aten._log_softmax_backward_data: per_element(4),  # "Backpropagating through GPT-2", log-softmax: 4·b·s·V
    **{op: per_element(1) for op in (aten.add, aten.add_, aten.sub, aten.sub_, aten.mul, aten.mul_, aten.div, aten.div_)},
}

def _without_tree_map(formula: Formula) -> Formula:
    """flop_counter's registry wraps each formula in `shape_wrapper`, which maps shapes over the arguments with
    pytree (~0.1 ms a call, most of the FLOP counter's cost on a small model). Their tensors are all top-level
    arguments or outputs, so the raw formula gets the same shapes from `_on_shapes`'s flat conversion."""
    raw = getattr(formula, "__wrapped__", None)
    if raw is None or formula.__code__.co_name != "nf":  # get_raw formulas take tensors: leave them as they are
        return formula

    def call_raw(*args, out_val=None, **kwargs):
        return raw(*args, out_shape=out_val, **kwargs)

    return _on_shapes(call_raw)


FLOP_FORMULAS: dict[object, Formula] = {
    **{op: _without_tree_map(f) for op, f in flop_counter.flop_registry.items()},
    **{op: _on_shapes(f) for op, f in _EXTRA.items()},
}


_OPS: dict[int, tuple[Formula | None, str]] = {}  # id(OpOverload) -> (formula, packet name); they live forever


def op_info(func: object) -> tuple[Formula | None, str]:
    """The FLOP formula of an aten call (None when none is registered for its overload packet) and the packet's
    name, looked up once per overload: hashing an OpOverloadPacket runs Python code, once per aten call otherwise."""
    info = _OPS.get(id(func))
    if info is None:
        packet = getattr(func, "_overloadpacket", None)
        info = _OPS[id(func)] = (FLOP_FORMULAS.get(packet), str(packet if packet is not None else func))
    return info


def gpt2_article_backward_terms(config: ModelConfig) -> dict[str, int]:
    """"Backpropagating through GPT-2"'s backward FLOPs for a GPT-2 stack, term by term (its 'Final Tally').

    Per layer: pre_attn_ln 11bsh, qkv_proj 12bsh², query@key 4·b·nh·s²·d, softmax 4·b·nh·s², scaling
    b·nh·s², attn@value 4·b·nh·s²·d, attn_out 4bsh², pre_mlp_ln 11bsh, mlp_up 16bsh², gelu 76bsh,
    mlp_down 16bsh². Then final_ln 11bsh and lm_head 4bshV. "Backpropagating through GPT-2" derives cross_entropy's 4bsV
    (log-softmax) but leaves it out of its total; it is listed here so the gap can be shown.
    """
    b, s, h, n_h, d, V, L = config.batch, config.seq, config.hidden, config.heads, config.head_dim, config.vocab, config.layers
    per_layer = {
        "pre_attn_ln": 11 * b * s * h,
        "qkv_proj": 12 * b * s * h**2,
        "query@key": 4 * b * n_h * s**2 * d,
        "softmax": 4 * b * n_h * s**2,
        "scaling": b * n_h * s**2,
        "attn@value": 4 * b * n_h * s**2 * d,
        "attn_out": 4 * b * s * h**2,
        "pre_mlp_ln": 11 * b * s * h,
        "mlp_up": 16 * b * s * h**2,
        "gelu": 76 * b * s * h,
        "mlp_down": 16 * b * s * h**2,
    }
    terms = {f"layers x {name}": L * value for name, value in per_layer.items()}
    terms["final_ln"] = 11 * b * s * h
    terms["lm_head"] = 4 * b * s * h * V
    terms["cross_entropy (not in the article's total)"] = 4 * b * s * V
    return terms


def gpt2_article_backward_total(config: ModelConfig) -> int:
    """"Backpropagating through GPT-2"'s closed form: n_L(48bsh² + 8·b·nh·s²·d + 5·b·nh·s² + 98bsh) + 11bsh + 4bshV."""
    b, s, h, n_h, d, V, L = config.batch, config.seq, config.hidden, config.heads, config.head_dim, config.vocab, config.layers
    return L * (48 * b * s * h**2 + 8 * b * n_h * s**2 * d + 5 * b * n_h * s**2 + 98 * b * s * h) + 11 * b * s * h + 4 * b * s * h * V
