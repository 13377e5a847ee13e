"""Meta tensors that behave as the real device would: the fused attention kernel a CPU or CUDA run would pick, and the
grouped matmul of a mixture of experts in float32 (which torch's meta kernel refuses but the CPU runs)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)
if GROUPED_MM is not None:
    GROUPED_MM = GROUPED_MM.default


def grouped_mm_on_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
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
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)  # meta, or a dry run's fake


# Normalisations whose CPU and CUDA kernels keep their saved statistics (mean, rstd / invstd) in float32 for a 16-bit
# input, where torch's meta kernels give them the input's dtype: a dry run under autocast counted bert-tiny's
# LayerNorm statistics and resnet-tiny's BatchNorm ones at half their bytes (256 and 2,400 B fewer than CPU).
NORM_STATISTICS = frozenset({torch.ops.aten.native_layer_norm.default, torch.ops.aten.native_batch_norm.default})
HALF = (torch.float16, torch.bfloat16)


def statistics_in_fp32(out: tuple, x: torch.Tensor) -> tuple:
    """A normalisation's (output, statistic, statistic) with the statistics in float32 when `x` is 16-bit."""
    if x.dtype not in HALF:
        return out
    output, *stats = out
    return (output, *(s.to(torch.float32) if s.dtype in HALF else s for s in stats))


# F.scaled_dot_product_attention is one attribute for the whole process, and two things replace it for a while: a meta
# dry run (fused_attention_on_meta, below) and context parallel's ring (torch's context_parallel, entered by
# graphviz_core.parallel.context). Each puts back what it found, which is only right when they do not overlap: torch's
# context_parallel, entered during a dry run, wraps the dry run's function and sets the wrapper under that function's
# name (F.sdpa), so the step runs plain attention, without its ring. So they take turns: whoever replaces the
# attribute holds this lock until it is put back.
SDPA_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def fused_attention_on_meta(cuda: bool) -> Iterator[None]:
    """On meta, SDPA takes its unfused math path; route meta calls to the fused kernel a real device runs.

    The target is this build's CPU kernel, or CUDA's (efficient for float32, flash for half) where `auto`
    picks CUDA, so a meta dry run shows the graph the real run would have. nn.MultiheadAttention calls SDPA
    through the same module global, so swapping it covers both; calls on other devices (other threads'
    captures) go to the original untouched.
    """
    aten = torch.ops.aten
    original = None  # what F.scaled_dot_product_attention was when this run's turn came (read under the lock)

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "meta":
            return original(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        # Both devices' SDPA turn a boolean mask into an additive one in the query's dtype first (ATen's
        # convert_boolean_attn_mask), and that is the tensor their kernels save for backward.
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(~bias, float("-inf"))
        if not cuda:
            out, _lse = aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=bias, scale=scale
            )
            return out
        if q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None:
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]

    with SDPA_SWAP_LOCK:
        # Read only once it is this run's turn: read before, a dry run waiting behind another would read the
        # other's swapped-in function, set it back on leaving, and leave it in place for good; every later
        # context-parallel step would then wrap that function instead of torch's and run without its ring.
        original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = sdpa
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original
