"""Where the saved bytes are: per layer (as the FLOPs tab groups them), per category, and the largest saved
tensors with their shapes and the node that keeps them. Reads only a Capture's graph."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from graphviz_core.analysis.flop_analysis import layer_of, layers_in_forward_order, node_parts
from graphviz_core.capture.result import Capture


@dataclass(frozen=True)
class SavedTensor:
    node: str  # the node whose backward needs it (the one its bytes are charged to)
    op: str
    module: str
    shape: tuple[int, ...]
    dtype: str
    storage_bytes: int


def saved_bytes_by_layer(capture: Capture) -> dict[str, int]:
    """Saved bytes per layer (the FLOPs tab's grouping, `flop_analysis.layer_of`), in forward order: embeddings,
    layers 0..N-1, final norm, head, then what is outside every module (loss and glue)."""
    totals: Counter[str] = Counter()
    for node, data in capture.graph.nodes(data=True):
        for module, _, saved_bytes, _ in node_parts(node, data):  # a compiled region's node: by module
            totals[layer_of(module)] += saved_bytes
    return {layer: totals[layer] for layer in layers_in_forward_order(capture) if totals[layer]}


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
