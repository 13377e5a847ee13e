"""Context parallelism with torch's own ring attention (torch.distributed.tensor.experimental.context_parallel).

torch's `context_parallel(mesh, buffers=...)` shards the input ids, targets and position ids on the sequence
dimension (each rank keeps two chunks, head and tail, so that causal attention costs every rank the same), and
patches `F.scaled_dot_product_attention` so that q, k and v enter as DTensors sharded on the sequence; DTensor then
hands the attention kernel to torch's ring (`_templated_ring_attention`): keys and values are all-gathered once per
attention forward and once per backward, and the key/value gradients travel rank to rank by all-to-all, C times.

One gap, and why: torch's CP table (`_context_parallel._attention.custom_ops` and its Shard(2) sharding rules)
lists the CUDA kernels only (`_scaled_dot_product_flash_attention`, `..._efficient_attention`,
`..._cudnn_attention`). On CPU, SDPA lowers to `aten._scaled_dot_product_flash_attention_for_cpu`, which has
neither a CP handler nor any DTensor sharding strategy, so the patched call fails with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered" (fake CUDA
tensors are no way round on a CPU build: SDPA falls back to its math kernel there and autograd then needs CUDA).
`cpu_ring_attention()` fills that gap the way torch fills it for CUDA: the CPU kernel and its backward, with the
same Shard(2) placements, routed through torch's own `_templated_ring_attention` / `_templated_ring_attention_backward`
(same rotation, same log-sum-exp merge, same load balancing). Nothing else is replaced.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from graphviz_core.capture.meta_kernels import SDPA_SWAP_LOCK

aten = torch.ops.aten
SEQ_DIM = 2  # (batch, heads, sequence, head dim): torch's ring attention hard-codes it too
_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    if attn_mask is not None:
        raise ValueError("context parallel attention takes no mask (causal attention only).")
    return _templated_ring_attention(
        mesh.get_group(), SEQ_DIM, _FORWARD, query, key, value, is_causal=is_causal, dropout_p=dropout_p, scale=scale
    )


def _ring_backward(
    mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward,
    )

    return _templated_ring_attention_backward(
        mesh.get_group(),
        SEQ_DIM,
        _BACKWARD,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


_RING_RUNS = threading.local()  # per thread: how many attention kernels ran as the ring


def _handler(op_call, args, kwargs):
    """torch's `_sdpa_handler`, for the CPU kernel: propagate the Shard(2) placements, run the ring on local shards."""
    from torch.distributed.tensor import DTensor

    _RING_RUNS.count = getattr(_RING_RUNS, "count", 0) + 1
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise AssertionError("context parallel attention expects q, k and v sharded on the sequence already")
    ring = _ring_forward if op_call is _FORWARD else _ring_backward
    local = ring(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local, sharding.output_spec)


def _forward_strategy(op_schema):
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    mesh = op_schema.get_mesh_from_args()
    # output, logsumexp | q, k, v: all replicated, or all sharded on the sequence (the CP strategy)
    strategies = [[Replicate()] * 5, [Shard(SEQ_DIM)] * 5]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=2)


def _backward_strategy(op_schema):
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    mesh = op_schema.get_mesh_from_args(validate=False)
    # grad q, k, v | grad output, q, k, v, output, logsumexp
    strategies = [[Replicate()] * 9, [Shard(SEQ_DIM)] * 9]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=3)


@contextlib.contextmanager
def cpu_ring_attention() -> Iterator[None]:
    """Route the CPU flash-attention kernel (forward and backward) through torch's ring attention while context
    parallel is on; restored on exit. Enter before torch's `context_parallel`, which reads the table on entry.

    Holds the process's SDPA swap lock throughout: torch's context_parallel replaces F.scaled_dot_product_attention,
    and so does a meta dry run in another thread (capture.meta_kernels); the two take turns."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    from torch.distributed.tensor.experimental._context_parallel._sharding_rules import _op_strategy_context

    with SDPA_SWAP_LOCK, contextlib.ExitStack() as stack:
        stack.enter_context(_op_strategy_context(_FORWARD, _forward_strategy, RuntimeSchemaInfo(3)))
        stack.enter_context(_op_strategy_context(_BACKWARD, _backward_strategy, None))
        cp_attention.custom_ops[_FORWARD] = _handler
        cp_attention.custom_ops[_BACKWARD] = _handler
        try:
            yield
        finally:
            cp_attention.custom_ops.pop(_FORWARD, None)
            cp_attention.custom_ops.pop(_BACKWARD, None)


@contextlib.contextmanager
def sequence_sharded(cp_mesh, buffers: list[torch.Tensor]) -> Iterator[None]:
    """torch's `context_parallel` over `cp_mesh`: `buffers` (batch, sequence) are cut to this rank's two chunks in
    place and SDPA runs as ring attention until exit. The buffers are not restored (the step is over by then)."""
    from torch.distributed.tensor.experimental import context_parallel

    before = getattr(_RING_RUNS, "count", 0)
    with (
        cpu_ring_attention(),
        _undone_after_an_error(),
        context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)),
    ):
        patched = F.scaled_dot_product_attention
        yield
        if getattr(_RING_RUNS, "count", 0) == before:  # every figure of the step would be the plain attention's
            raise RuntimeError(
                "context parallel: the step's attention did not run as torch's ring, so its figures are not context "
                f"parallel's (F.scaled_dot_product_attention: {_name(patched)} on entry, {_name(F.scaled_dot_product_attention)} "
                f"now, in thread {threading.current_thread().name})")


@contextlib.contextmanager
def _undone_after_an_error() -> Iterator[None]:
    """What torch's context_parallel changes, undone however its body ends. torch 2.11's context_parallel undoes its
    changes after its `yield`, outside any `finally` (2.13's in one): a step that raised inside it (a cancel, the run
    time limit, the ring check below) left its wrapper in F.scaled_dot_product_attention and its handlers in DTensor's
    dispatcher for the rest of the process, and every later capture with attention then failed ("Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered", seen on
    an H200 box with torch 2.11 after this module's ring-check test). Undone here with torch's own clean-up."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    sdpa = F.scaled_dot_product_attention
    try:
        yield
    finally:
        if F.scaled_dot_product_attention is not sdpa:
            cp_attention._disable_context_parallel_dispatcher_impl()
            F.scaled_dot_product_attention = sdpa


def _name(function) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def kv_exchange_bytes(batch: int, seq: int, kv_width: int, element_bytes: int, cp: int) -> dict[str, int]:
    """Bytes one rank sends per attention layer in torch's ring (all-gather rotation, the default): forward gathers
    this rank's keys and values once ((cp - 1) x its 2·b·(s/cp)·kv_width elements sent, ring volume); backward
    gathers them again and passes the key/value gradients on cp times by all-to-all, in float32 (the ring
    accumulates gradients in float32), 2·b·(s/cp)·kv_width x 4 bytes each time."""
    local_kv = 2 * batch * (seq // cp) * kv_width
    gather = (cp - 1) * local_kv * element_bytes
    return {"forward_bytes": gather, "backward_bytes": gather + cp * local_kv * 4}


def context_parallel_step(workload, parallel, meshes: dict, inputs, targets):
    """(a context to hold the step in, the forward to call). Under context parallelism torch's context_parallel
    cuts the ids, targets and positions to this rank's chunks in place (before tracking starts) and runs attention
    as its ring until the step ends; the model gets the positions its chunks hold."""
    step = contextlib.ExitStack()
    if parallel.cp == 1:
        return step, workload.forward
    positions = torch.arange(inputs.shape[1]).expand(inputs.shape).contiguous()
    step.enter_context(sequence_sharded(meshes["cp"], [inputs, targets, positions]))
    return step, lambda model, x: model(x, position_ids=positions)
