"""Activation checkpointing as the models run it: the policies (`full`, `selective-ops`, `selective-ops-torchtitan`),
the `context_fn` of each selective one, and the attributes a model sets for the capture to read (the inputs a
checkpoint keeps for recomputation, the op outputs a selective policy stores itself). The teaching models
(graphviz_core.models.teaching) and the Hugging Face ones (graphviz_core.models.hf) both run layers through here.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# Set on modules whose forward runs under torch.utils.checkpoint: the capture counts the inputs that the
# checkpoint keeps for recomputation, which no saved-tensor hook sees.
RECOMPUTED = "recomputed_in_backward"
# Set on a model whose layers run a selective-checkpoint policy (graphviz_core.models.hf): the bytes of the op outputs
# the policy stored in forward, which the checkpoint keeps itself where no saved-tensor hook sees them.
KEPT_BYTES = "selective_checkpoint_kept_bytes"

# No model here draws random numbers in forward (no dropout), so recompute needs no saved RNG state; and saving it
# is harmful on a shared server: checkpoint's recompute sets torch's one global generator back to the forward's
# state (and restores it after), which would corrupt a model that another thread is initialising from that generator
# under graphviz_core.models.registry's build lock: that model would get other weights than its seed gives.
CHECKPOINT_KWARGS = {"use_reentrant": False, "preserve_rng_state": False}

# `selective-ops` (torchtitan's op-level selective activation checkpointing), for every family: inside a checkpointed
# layer, keep the outputs of the compute-heavy ops (matrix multiplications, convolutions, attention kernels: expensive
# to recompute) and recompute everything else (norms, activations, rotary, elementwise: cheap per byte kept).
# torchtitan also recomputes every second mm to balance memory; this policy keeps them all (that one is
# `selective-ops-torchtitan`, below).
KEEP_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


# `selective-ops-torchtitan`: torchtitan's op-level selective activation checkpointing exactly ("TorchTitan:
# One-stop PyTorch native solution for production ready LLM pre-training"; repo pytorch/torchtitan,
# torchtitan/parallelisms/parallelize_llama.py, `_save_list` and `_get_custom_policy`, Dec 2024): keep the outputs of
# the ops in its save list except every second aten.mm of each checkpointed layer run (a count of mm calls that
# starts at 0 for every run of the layer: the 2nd, 4th, 6th... are recomputed), recompute everything else. Like
# torchtitan it counts forward and recompute apart; this torch asks the policy in forward only and replays those
# decisions in the recompute (SelectiveCheckpointContext.is_recompute is always False). Its list names the CUDA attention kernels; the CPU's fused kernel, which SDPA runs here
# on CPU (and on meta for a CPU target), stands in for them. Not in it: aten.addmm (a Linear with a bias), bmm,
# convolutions, grouped expert matmuls: recomputed.
MM = torch.ops.aten.mm.default
TORCHTITAN_SAVE_OPS = {
    MM,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,  # the CPU's stand-in for the two above
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    # for low precision training torchtitan always saves the result of max(abs(tensor))
    torch.ops.aten.abs.default,
    torch.ops.aten.max.default,
}


def _count_kept(model: nn.Module, ctx, op, args, kwargs) -> None:
    """Add the bytes of `op`'s output to `model`'s KEPT_BYTES: the checkpoint stores these outputs itself, where no
    saved-tensor hook sees them. torch hands the policy the output (`ctx.op_output`); a tensor-parallel DTensor
    keeps its local shard (`_local_tensor`), the bytes this rank holds. Without `op_output` (an older torch) the op
    runs again on meta copies of its arguments (shapes only, no arithmetic)."""
    out = getattr(ctx, "op_output", None)
    if out is None:
        # With the dispatch modes below this one switched off: the capture's FLOP counter and storage observer
        # would otherwise count this shape computation as a second forward op, adding its FLOPs to the forward's.
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            meta = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
            out = op(*meta[0], **meta[1])
    tensors = (getattr(t, "_local_tensor", t) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    kept = sum(t.numel() * t.element_size() for t in tensors)
    setattr(model, KEPT_BYTES, getattr(model, KEPT_BYTES, 0) + kept)


def _keep_compute_heavy(model: nn.Module, ctx, op, *args, **kwargs):
    if op not in KEEP_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        _count_kept(model, ctx, op, args, kwargs)
    return CheckpointPolicy.MUST_SAVE


def keep_compute_heavy_contexts(model: nn.Module):
    """`context_fn` for torch.utils.checkpoint running the `selective-ops` policy; the bytes it keeps are added up
    on `model` (KEPT_BYTES), the whole model the capture reads them from."""
    return partial(create_selective_checkpoint_contexts, partial(_keep_compute_heavy, model))


def _torchtitan_policy(model: nn.Module, mm_counts: dict, ctx, op, *args, **kwargs):
    mode = "recompute" if ctx.is_recompute else "forward"
    if op == MM:
        mm_counts[mode] += 1
    if op not in TORCHTITAN_SAVE_OPS or (op == MM and mm_counts[mode] % 2 == 0):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        _count_kept(model, ctx, op, args, kwargs)
    return CheckpointPolicy.MUST_SAVE


def torchtitan_contexts(model: nn.Module):
    """`context_fn` for torch.utils.checkpoint running `selective-ops-torchtitan`: called once per checkpointed run
    of a layer, each call with its own mm counts, as torchtitan's `selective_checkpointing_context_fn`."""

    def context_fn():
        return create_selective_checkpoint_contexts(partial(_torchtitan_policy, model, {"forward": 0, "recompute": 0}))

    return context_fn


# The selective policies that checkpoint whole layers, each with the `context_fn` maker of its op policy.
SELECTIVE_OPS_CONTEXTS = {"selective-ops": keep_compute_heavy_contexts, "selective-ops-torchtitan": torchtitan_contexts}


def run_checkpointed(layer, x: torch.Tensor, policy: str, model: nn.Module) -> torch.Tensor:
    """`layer(x)` under the config's checkpoint policy: whole (`full`), keeping some ops' outputs (`selective-ops`,
    `selective-ops-torchtitan`), or plain (`none`, and `selective-attention`, which checkpoints inside the attention)."""
    if policy == "full":
        return checkpoint(layer, x, **CHECKPOINT_KWARGS)
    if policy in SELECTIVE_OPS_CONTEXTS:
        return checkpoint(layer, x, **CHECKPOINT_KWARGS, context_fn=SELECTIVE_OPS_CONTEXTS[policy](model))
    return layer(x)


LAYER_POLICIES = ("full", *SELECTIVE_OPS_CONTEXTS)  # the policies that checkpoint whole layers
