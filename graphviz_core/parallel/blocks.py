"""The model's repeated blocks: what FSDP wraps one by one, tensor parallelism splits, and a pipeline cuts between."""

from __future__ import annotations

from torch import nn


def repeated_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP wraps one by one: the children of the longest nn.ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def attribute(root: nn.Module, path: str):
    """The attribute at a dotted `path` from `root` ("model.layers"), as a family's plan names its parts."""
    for part in path.split("."):
        root = getattr(root, part)
    return root


def replace_attribute(root: nn.Module, path: str, value) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(attribute(root, parent) if parent else root, leaf, value)
