"""Data parallelism with torch's composable APIs: FSDP2 (`fully_shard`, one unit per layer and the root) and HSDP over a
2-D mesh, DDP as `replicate`; FSDP2's own mixed-precision policy where the layout asks for it."""

from __future__ import annotations

import torch
from torch import nn

from graphviz_core.parallel.settings import FSDP_STRATEGIES, ParallelConfig


def apply_data_parallel(model: nn.Module, layers: list[nn.Module], parallel: ParallelConfig, meshes: dict) -> None:
    """Wrap each of `layers`, then the root, as `parallel.strategy` says (nothing for tensor parallel alone or none)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    strategy = parallel.strategy
    mp = MixedPrecisionPolicy()
    if parallel.mixed_precision != "none":
        reduce = torch.float32 if parallel.mixed_precision == "bf16-fp32-reduce" else torch.bfloat16
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    if strategy in FSDP_STRATEGIES:
        for layer in layers:
            fully_shard(layer, mesh=meshes["dp"], reshard_after_forward=parallel.reshard_after_forward, mp_policy=mp)
        # The root (embeddings, final norm, head) as training scripts wrap it: torchtitan calls fully_shard(model)
        # without the argument, and FSDP2's default (None) then keeps the root unsharded after forward, since
        # backward needs its parameters first (FSDPState._lazy_init). Turning resharding off turns it off here too.
        fully_shard(model, mesh=meshes["dp"], reshard_after_forward=None if parallel.reshard_after_forward else False,
                    mp_policy=mp)
    elif strategy == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for layer in layers:
            replicate(layer, mesh=meshes["dp"], mp_policy=mp)
        replicate(model, mesh=meshes["dp"], mp_policy=mp)


def resharded_after_forward(model: nn.Module) -> dict[str, bool]:
    """Each FSDP unit's resharding as FSDP2 settled it in its lazy init (the root's default is decided there)."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out[name] = group.post_forward_mesh_info is not None
    return out
