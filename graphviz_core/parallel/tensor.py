"""Tensor parallelism (Megatron-LM's column / row split of each layer's projections) with torch's own parallel styles
(`parallelize_module`, `ColwiseParallel`, `RowwiseParallel`), LoRA adapters split as peft splits them; sequence
parallelism's styles come from graphviz_core.parallel.sequence."""

from __future__ import annotations

from torch import nn

from graphviz_core.models.family import ParallelPlan
from graphviz_core.parallel import sequence
from graphviz_core.parallel.blocks import repeated_layers
from graphviz_core.parallel.settings import ParallelConfig


def tp_plan(layer: nn.Module, declared: ParallelPlan, sequence_parallel: bool = False) -> dict:
    """Megatron column/row styles for the nn.Linear projections inside one layer. A projection peft wrapped with LoRA
    is split as peft splits one under transformers' tensor parallelism (peft's add_lora_tp_hooks_dtensor): the base
    layer as the projection; under a column split lora_B by columns too and lora_A whole on every rank, under a row
    split lora_A by rows (its (b, s, r) output all-reduced) and lora_B whole. Under sequence parallel that B reads
    this rank's tokens only: a replicated DTensor then, so that its gradient is summed over the ranks. Which
    projection is split how is the family's declaration (`declared`, models.family.ParallelPlan)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for name, module in layer.named_modules():
        style = declared.tensor_style(name) if name else None
        column, row = style == "colwise", style == "rowwise"
        if isinstance(module, nn.Linear) and (column or row):
            plan[name] = ColwiseParallel() if column else RowwiseParallel()
        elif (column or row) and isinstance(getattr(module, "base_layer", None), nn.Linear) and hasattr(module, "lora_A"):
            plan[f"{name}.base_layer"] = ColwiseParallel() if column else RowwiseParallel()
            for adapter in module.lora_A:
                plan[f"{name}.lora_A.{adapter}"] = _replicated_adapter() if column else RowwiseParallel()
                if column:  # under a row split lora_B stays a plain layer: its input is whole on every rank
                    plan[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
                elif sequence_parallel:
                    plan[f"{name}.lora_B.{adapter}"] = _replicated_adapter(tokens_split=True)
    return plan


def _replicated_adapter(tokens_split: bool = False):
    """The style of LoRA's A beside a column-split projection: whole on every tensor-parallel rank, a replicated
    DTensor like the block input it reads (a plain layer would meet that DTensor, and torch refuses mixed tensors).
    Its (b, s, r) output leaves as a local tensor, so that B's column split takes it back as replicated and backward
    all-reduces its gradient there, once (Megatron's f); A's weight gradient is then whole, not a partial sum that
    every optimizer op would all-reduce again. With `tokens_split`, B beside a row-split projection under sequence
    parallel: its input is this rank's tokens (a local tensor, taken as sharded on the sequence), so its weight
    gradient is a partial sum, as a sequence-parallel norm's is."""
    from torch.distributed.tensor import DTensor, Shard, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    def tokens(mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Shard(1)], run_check=False) for x in inputs)

    class ReplicatedAdapter(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            return distribute_module(module, device_mesh, input_fn=tokens if tokens_split else None,
                                     output_fn=lambda mod, out, mesh: out.to_local())

    return ReplicatedAdapter()


def _projection(name: str) -> str:
    """The projection a plan entry belongs to: `self_attn.q_proj` for `self_attn.q_proj.base_layer` or
    `self_attn.q_proj.lora_B.default` (peft's LoRA wrapper), the name itself otherwise."""
    parts = name.split(".")
    cut = next((i for i, part in enumerate(parts) if part == "base_layer" or part.startswith("lora_")), len(parts))
    return ".".join(parts[:cut])


def _column_parallel_parents(layer: nn.Module, plan: dict) -> list[nn.Module]:
    """The modules (attention, MLP) whose input feeds column-split projections."""
    parents = {_projection(name).rpartition(".")[0] for name, style in plan.items()
               if type(style).__name__ == "ColwiseParallel"}
    return [layer.get_submodule(name) for name in sorted(parents)]


def _replicated_input(block: nn.Module, sequence_parallel: bool = False):
    """Megatron's `f`: the block's input enters as one replicated DTensor shared by its column-split projections,
    so backward sums their partial input gradients and all-reduces them once per block. Without it each of
    q, k, v (or gate, up) converts the input itself and backward issues one all-reduce per projection.

    Hugging Face attention takes `hidden_states` by keyword; the other blocks take their input by position."""
    import inspect

    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput

    first = next(iter(inspect.signature(block.forward).parameters), "")
    if sequence_parallel:  # the input arrives sharded on the sequence: all-gathered here instead
        return sequence.gathered_input(block, keyword=first == "hidden_states")
    if first == "hidden_states":
        return PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        )
    return PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )


def _keep_frozen(model: nn.Module, frozen: set[str]) -> None:
    """Freeze again what --freeze froze: torch's SequenceParallel style re-registers a norm's weight as a new
    nn.Parameter without its requires_grad (style.py, _replicate_module_fn), so a frozen norm would train."""
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


def tp_split_bytes(model: nn.Module, declared: ParallelPlan, trained_only: bool = False) -> int:
    """Bytes that tensor parallelism splits: the planned projections' weights and the column-split biases (a
    row-split projection's bias is added after the all-reduce, so every TP rank keeps it whole)."""
    total = 0
    for layer in repeated_layers(model):
        for name, style in tp_plan(layer, declared).items():
            for pname, p in layer.get_submodule(name).named_parameters():
                if (trained_only and not p.requires_grad) or type(style).__name__ == "ReplicatedAdapter":
                    continue
                if pname == "weight" or type(style).__name__ == "ColwiseParallel":
                    total += p.numel() * p.element_size()
    return total


def apply_tensor_parallel(
    model: nn.Module, layers: list[nn.Module], parallel: ParallelConfig, meshes: dict, declared: ParallelPlan
) -> list[nn.Module]:
    """Split each of `layers`' projections over the tensor-parallel mesh (sequence parallel too where `parallel` says);
    returns the blocks (attention, MLP) whose input enters as one replicated DTensor."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp_blocks: list[nn.Module] = []
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    for layer in layers:
        plan = tp_plan(layer, declared, parallel.sequence_parallel)
        if not plan:
            raise ValueError("tensor parallelism found no attention or MLP projections to split in this model.")
        parents = _column_parallel_parents(layer, plan)
        if parallel.sequence_parallel:
            plan = sequence.sequence_parallel_plan(layer, plan)
        parallelize_module(layer, meshes["tp"], plan)
        for block in parents:
            parallelize_module(block, meshes["tp"], _replicated_input(block, parallel.sequence_parallel))
            tp_blocks.append(block)
    if parallel.sequence_parallel:
        sequence.shard_between_layers(model, layers, meshes["tp"], declared.stages)
        _keep_frozen(model, frozen)
    return tp_blocks
