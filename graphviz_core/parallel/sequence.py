"""Megatron sequence parallelism inside tensor parallelism, with torch's own parallel styles (as torchtitan's Llama
plan applies them): the norms run on this rank's s/tp tokens (`SequenceParallel`), the attention and MLP all-gather
their input back to the whole sequence before the column-split projections (`PrepareModuleInput`, Shard(1) ->
Replicate), and the row-split projections reduce-scatter their output to the sequence shard instead of
all-reducing it (`RowwiseParallel(output_layouts=Shard(1))`). Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", section 4.2.2.

Where this differs from torchtitan, and why: the token embedding and the head stay whole on every rank (this
project's tensor parallelism splits the layers' projections only), so the embedding's output is cut to the
sequence shard at the first layer's input (a local slice, no traffic) where torchtitan's vocabulary-split embedding
reduce-scatters it; the final norm runs on the shard and the head's input is all-gathered.
"""

from __future__ import annotations

from torch import nn

from graphviz_core.models.family import StageSplit
from graphviz_core.parallel.blocks import attribute

SEQUENCE_DIM = 1  # (batch, sequence, hidden) between layers


def norm_names(layer: nn.Module) -> list[str]:
    """The layer's normalisation modules (RMSNorm / LayerNorm), by their path inside the layer."""
    return [name for name, m in layer.named_modules() if name and type(m).__name__.endswith("Norm")]


def sequence_parallel_plan(layer: nn.Module, plan: dict) -> dict:
    """`plan` (the layer's Megatron column/row styles) with the row-split projections' output left sharded on the
    sequence and the norms sequence-parallel."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    out = {}
    for name, style in plan.items():
        row = type(style).__name__ == "RowwiseParallel"
        out[name] = RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM)) if row else style
    for name in norm_names(layer):
        out[name] = SequenceParallel(sequence_dim=SEQUENCE_DIM)
    return out


def gathered_input(block: nn.Module, keyword: bool):
    """The attention / MLP input enters sequence-sharded and is all-gathered once for the column-split projections
    (Megatron's g: all-gather forward, reduce-scatter backward)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    if keyword:
        return PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(SEQUENCE_DIM)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        )
    return PrepareModuleInput(
        input_layouts=(Shard(SEQUENCE_DIM),), desired_input_layouts=(Replicate(),), use_local_output=False
    )


def shard_between_layers(model: nn.Module, layers: list[nn.Module], tp_mesh, split: StageSplit) -> None:
    """The residual stream on the sequence shard from the first layer's input to the final norm; the head gets the
    whole sequence back (an all-gather). `split` names the model's embedding, final norm and head (its family's plan,
    models.family.StageSplit, paths from `model`).

    A pipeline stage (graphviz_core.parallel.pipeline.build_stage) without the embedding receives the hidden states
    already on the sequence shard, and one without the head (its norm and head nn.Identity) sends them on the shard:
    each tensor-parallel rank passes its s/t tokens to the same rank of the next stage, as torchtitan's stages do."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel, parallelize_module

    if attribute(model, split.embedding) is not None:  # the embedding's output is whole: cut it here
        first = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(SEQUENCE_DIM),), use_local_output=True
        )
        parallelize_module(layers[0], tp_mesh, first)
    norm, head = attribute(model, split.norm), attribute(model, split.head)
    if isinstance(norm, nn.Identity) and isinstance(head, nn.Identity):  # a pipeline stage before the last
        return
    parallelize_module(norm, tp_mesh, SequenceParallel(sequence_dim=SEQUENCE_DIM, use_local_output=True))
    gather = PrepareModuleInput(
        input_layouts=(Shard(SEQUENCE_DIM),), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    parallelize_module(head, tp_mesh, gather)
