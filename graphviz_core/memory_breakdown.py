"""Where the saved bytes are: per layer (module path cut to a depth), per category, and the largest saved
tensors with their shapes and the node that keeps them. Reads only a Capture's graph."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from graphviz_core.capture import Capture


@dataclass(frozen=True)
class SavedTensor:
    node: str  # the node whose backward needs it (the one its bytes are charged to)
    op: str
    module: str
    shape: tuple[int, ...]
    dtype: str
    storage_bytes: int


def layer_of(module: str, depth: int = 2) -> str:
    """`blocks.3.attn.qkv` -> `blocks.3` at depth 2; names without an index keep their first part (`lm_head`)."""
    if not module:
        return "(outside modules: loss, glue)"
    parts = module.split(".")
    if len(parts) > 1 and parts[1].isdigit():
        return ".".join(parts[:depth])
    return parts[0]


def saved_bytes_by_layer(capture: Capture, depth: int = 2) -> dict[str, int]:
    """Saved bytes per layer, in the order layers first appear in the forward (the graph's reverse order)."""
    totals: Counter[str] = Counter()
    for _, data in reversed(list(capture.graph.nodes(data=True))):
        if data["saved_bytes"]:
            totals[layer_of(data["module"], depth)] += data["saved_bytes"]
    return dict(totals)


def largest_saved_tensors(capture: Capture, count: int = 10) -> list[SavedTensor]:
    """The `count` largest counted saves (storages de-duplicated, parameters excluded), largest first."""
    found = []
    for node, data in capture.graph.nodes(data=True):
        for saved in data["saved"]:
            if saved["counted"]:
                found.append(
                    SavedTensor(node, data["op"], data["module"], tuple(saved["shape"]), saved["dtype"], saved["bytes"])
                )
    found.sort(key=lambda t: -t.storage_bytes)
    return found[:count]
