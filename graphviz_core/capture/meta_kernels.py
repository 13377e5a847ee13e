"""Meta tensors that behave as the real device would: the fused attention kernel a CPU or CUDA run would pick, and the
grouped matmul of a mixture of experts in float32 (which torch's meta kernel refuses but the CPU runs)."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
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


def cuda_attention_kernel(q: torch.Tensor, k: torch.Tensor, attn_mask, enable_gqa: bool) -> str:
    """The SDPA kernel a CUDA GPU runs for these inputs: "flash", "efficient" or "math" (the unfused ops).

    Read off an NVIDIA H200 with torch 2.11 (benchmarks/gpu_sdpa_choice.py, docs/team-server.md): float32 runs the
    memory-efficient kernel unless the keys have fewer heads than the queries (grouped-query attention: llama,
    mistral, qwen2, gemma3 and transformers passes enable_gqa), which that kernel does not take, so torch runs the
    math path (the b x heads x s x s scores kept); half precision runs a fused kernel. That H200 ran cuDNN's
    (torch prefers it on sm90/sm100), other GPUs flash attention, which takes no mask; flash is named here, as
    telling them apart would start CUDA in this process: the two keep the same tensors for backward to a few bytes
    (llama-tiny in bfloat16: 481,588 B in the dry run, 481,572 B on the H200).
    """
    if q.dtype in HALF and attn_mask is None:
        return "flash"
    return "math" if enable_gqa and k.shape[-3] != q.shape[-3] else "efficient"


@contextlib.contextmanager
def fused_attention_on_meta(cuda: bool) -> Iterator[None]:
    """On meta, SDPA takes its unfused math path; route meta calls to the fused kernel a real device runs.

    The target is this build's CPU kernel, or CUDA's (cuda_attention_kernel) where `auto` picks CUDA, so a meta
    dry run shows the graph the real run would have. nn.MultiheadAttention calls SDPA through the same module
    global, so swapping it covers both; calls on other devices (other threads' captures) go to the original
    untouched.
    """
    aten = torch.ops.aten
    original = None  # what F.scaled_dot_product_attention was when this run's turn came (read under the lock)

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "meta":
            return original(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        kernel = cuda_attention_kernel(q, k, attn_mask, enable_gqa) if cuda else "cpu"
        if kernel == "math":  # on meta, SDPA's own choice is the math path: the ops CUDA runs
            return original(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        # Both devices' SDPA turn a boolean mask into an additive one in the query's dtype first (ATen's
        # convert_boolean_attn_mask), and that is the tensor their kernels save for backward.
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(~bias, float("-inf"))
        if kernel == "cpu":
            out, _lse = aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=bias, scale=scale
            )
            return out
        if kernel == "flash":
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


class _Routing:
    """The threads whose attention takes CUDA's path (cuda_attention), and torch's function while any does."""

    lock = threading.Lock()
    threads: Counter = Counter()  # thread ident -> how many cuda_attention contexts it is in
    original = None


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    """In this thread, F.scaled_dot_product_attention takes the path a CUDA GPU would (cuda_attention_kernel) where
    that path is the math one, and the GPU's kernels count their own workspaces (cuda_temporary_bytes): the parallel
    simulation runs on fake CPU tensors, whose fused kernel takes grouped heads in float32, where the GPU keeps every
    layer's b x heads x s x s attention weights (a float32 Llama 3.1 8B step, 2 layers, s=4096: 2.5 GiB more on an
    H200 than simulated). The module's function is swapped (holding the swap lock, as a dry run does) rather than a
    torch-function mode entered: checkpointing recomputes the attention in backward with no such mode active. A
    pipeline's or a world's rank threads enter it each; the first in swaps, the last out puts torch's back; other
    threads' calls go to torch's untouched."""
    ident = threading.get_ident()
    with _Routing.lock:
        if not _Routing.threads:
            SDPA_SWAP_LOCK.acquire()  # released by whichever thread leaves last
            _Routing.original = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _routed_sdpa
        _Routing.threads[ident] += 1
    try:
        yield
    finally:
        with _Routing.lock:
            _Routing.threads[ident] -= 1
            if _Routing.threads[ident] == 0:
                del _Routing.threads[ident]
            if not _Routing.threads:
                F.scaled_dot_product_attention = _Routing.original
                _Routing.original = None
                SDPA_SWAP_LOCK.release()


def routes_as_cuda() -> bool:
    """Whether this thread's kernels are taken as a CUDA GPU's (inside cuda_attention)."""
    return threading.get_ident() in _Routing.threads


def _routed_sdpa(*args, **kwargs):
    if routes_as_cuda() and not _distributed(args):
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if cuda_attention_kernel(args[0], args[1], mask, kwargs.get("enable_gqa", False)) == "math":
            return _math_attention(*args, **kwargs)
    return _Routing.original(*args, **kwargs)


def _distributed(args: tuple) -> bool:
    """Whether any of SDPA's tensors is a DTensor: left to torch's own SDPA, whose sharding rules cover the fused
    kernels (the math path's op has none)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(a, DTensor) for a in args)


def _math_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's math path (the ops CUDA runs: q @ k^T, _safe_softmax, @ v), whatever this device would pick."""
    out, _weights = torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )
    return out


def cuda_temporary_bytes(func, args: tuple) -> int:
    """Bytes a CUDA kernel holds while it runs beyond its inputs and output, which a fake tensor cannot show, in a
    thread inside cuda_attention (else 0): read off an H200 (torch 2.11, benchmarks/gpu_sdpa_choice.py) for every
    softmax length from 256 to 8,192 in float32 and bfloat16: `_safe_softmax` (the math path's softmax) 1 byte per
    element (its mask of fully masked rows), and `_softmax_backward_data` a copy of its output's size."""
    if func not in (SAFE_SOFTMAX, SOFTMAX_BACKWARD) or not routes_as_cuda():
        return 0
    return args[0].numel() * (1 if func is SAFE_SOFTMAX else args[0].element_size())


SAFE_SOFTMAX = torch.ops.aten._safe_softmax.default
SOFTMAX_BACKWARD = torch.ops.aten._softmax_backward_data.default
