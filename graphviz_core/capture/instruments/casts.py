"""Autocast's casts: which `ToCopyBackward0` nodes `torch.autocast` made, and the 16-bit weight copies it saved.

Under `torch.autocast` an op on its lower-precision list (linear, matmul, SDPA...) casts its floating inputs to the
autocast dtype, and an op on its float32 list (cross-entropy...) casts them up; each cast of a tensor that needs a
gradient is an autograd `ToCopyBackward0` node. The model's own conversions (`x.to(torch.float32)` in an RMSNorm,
`.float()`, `.type_as(...)`) make the same node. They are told apart by where the node was made: a torch-function
mode sees every Python-level torch call of the model, and autograd numbers the nodes a thread makes in order
(`_sequence_nr`), so the numbers given out inside a call of a conversion method belong to the model's own casts;
every other `ToCopyBackward0` made during the forward under autocast is autocast's (category `cast`).

A cast of a parameter (its input is the parameter's `AccumulateGrad`) makes the 16-bit copy of an fp32 weight that
autocast caches for the forward and the consuming op saves for backward; those copies' bytes are read from the
consumers' saved tensors (storages counted once) after the forward.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from graphviz_core.capture.instrument import Instrument, Run
from graphviz_core.capture.walk import next_sequence_nr, saved_fields, storage_key

CAST_OP = "ToCopyBackward0"
# Tensor methods a model calls to convert a tensor itself: the nodes they make stay `conversion`.
# Autograd nodes of views: their output shares its input's storage.
VIEWS = frozenset({"TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0", "ExpandBackward0",
                   "UnsqueezeBackward0", "SqueezeBackward0", "AliasBackward0", "UnsafeViewBackward0",
                   "ReshapeAliasBackward0"})
CONVERSIONS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as", "_to_copy", "to_dtype"})


class _ConversionCalls(TorchFunctionMode):
    """Records the sequence numbers handed out inside the model's own conversion calls (top-level calls only: a torch
    function mode is switched off while its handler runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.own: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in CONVERSIONS:
            return func(*args, **(kwargs or {}))
        first = next_sequence_nr()
        out = func(*args, **(kwargs or {}))
        self.own.update(range(first, next_sequence_nr()))
        return out


class AutocastCasts(Instrument):
    """Present in every capture run under autocast (the graph's categories need it): the `cast` nodes, and the bytes
    of the 16-bit weight copies saved for backward."""

    name = "casts"

    def start(self, run: Run) -> None:
        super().start(run)
        self.calls = _ConversionCalls()
        self.first = self.end = 0  # sequence numbers given out during the forward
        self.cast_ids: set[str] = set()
        self.weight_copy_bytes = 0
        self.weight_casts = 0

    def forward_contexts(self, run: Run) -> list:
        return [self.calls, _Span(self)]

    def after_forward(self, run: Run) -> None:
        parameter_casts = []
        for node in run.nodes:
            if node.name() != CAST_OP or not self.first <= node._sequence_nr() < self.end:
                continue
            if node._sequence_nr() in self.calls.own:
                continue
            self.cast_ids.add(run.ids[node])
            child = node.next_functions[0][0]
            if child is not None and run.ops.get(child) == "AccumulateGrad":
                parameter_casts.append(node)
        self.weight_casts = len(parameter_casts)
        self.weight_copy_bytes = self._saved_copy_bytes(run, set(parameter_casts))

    @staticmethod
    def _saved_copy_bytes(run: Run, casts: set) -> int:
        """Bytes of the parameter casts' outputs that some node saved for backward, each storage once. A node is
        known by its sequence number (a tensor's grad_fn may be a fresh Python object for the same node)."""
        numbers = {node._sequence_nr() for node in casts}

        def is_copy(t: torch.Tensor) -> bool:
            node = t.grad_fn  # a saved view (a linear saves the copy's transpose) leads to the copy through views
            while node is not None and node.name() in VIEWS:
                node = node.next_functions[0][0]
            return node is not None and node.name() == CAST_OP and node._sequence_nr() in numbers

        recomputed = run.modules.recomputed_nodes
        storages: dict[int, int] = {}
        for node in run.nodes:
            if node in recomputed:  # reading its fields would run checkpoint's recomputation
                continue
            for name in saved_fields(node):
                try:
                    value = getattr(node, name)
                except RuntimeError:
                    continue
                for t in value if isinstance(value, tuple) else (value,):
                    # A linear saves the copy's transpose: a view, whose base is the copy itself.
                    if isinstance(t, torch.Tensor) and is_copy(t):
                        key, nbytes = storage_key(t)
                        storages[key] = nbytes
        return sum(storages.values())

    def annotate(self, node_id: str, record: dict) -> None:
        if node_id in self.cast_ids:
            record["category"] = "cast"

    def release(self) -> None:
        self.cast_ids = set()
        self.calls.own.clear()


class _Span:
    """Notes the sequence numbers at the start and end of the forward."""

    def __init__(self, owner: AutocastCasts) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        self.owner.first = next_sequence_nr()

    def __exit__(self, *exc) -> None:
        self.owner.end = next_sequence_nr()
