"""The op names the user's own run gives, where the capture's dispatch mode changes them.

The capture watches every aten op through one TorchDispatchMode (graphviz_core.capture.engine). While any dispatch mode
is active, ATen's `reshape` treats every tensor as a subclass (`at::isTensorSubclassLike`) and makes a view that
needs no copy with `view` instead of `_reshape_alias`: the node autograd records is then `ViewBackward0` where a
plain run records `ReshapeAliasBackward0`. Nothing else about it differs (the same input, output, saved sizes and
gradient). Llama has 3 such nodes, Gemma 3 6; the shipped models show no other difference.

The capture does not run the forward a second time to learn the plain names: that extra run would draw from the
process's random state (shared by every thread of a server building models at the same moment) and run a
checkpointed model's recompute bookkeeping twice. Instead the candidates are counted in the measured forward
(`ReshapeViews`: the views of a non-contiguous input, known by autograd's sequence number) and the graph's notes
say what a plain run may name otherwise, and why.
"""

from __future__ import annotations

import torch

from graphviz_core.capture.walk import next_sequence_nr

VIEW = torch.ops.aten.view.default


class ReshapeViews:
    """In the forward's dispatch mode: the sequence numbers of the ViewBackward0 nodes made from a non-contiguous
    input, the ones a plain run may name ReshapeAliasBackward0 (when `reshape` made them)."""

    def __init__(self) -> None:
        self.sequence_nrs: set[int] = set()

    def observe(self, func, args, kwargs, out) -> None:
        if func is VIEW and isinstance(args[0], torch.Tensor) and args[0].requires_grad \
                and not args[0].is_contiguous():
            self.sequence_nrs.add(next_sequence_nr() - 1)  # autograd made the view's node before dispatching here


def note(candidates: int) -> str:
    """The graph's note: how many of its ViewBackward0 nodes a run without the capture's mode may name otherwise."""
    return (f"{candidates:,} ViewBackward0 node(s) here view a non-contiguous tensor: where the model called reshape "
            "there, a run without this capture's dispatch mode records ReshapeAliasBackward0 instead (ATen's reshape "
            "makes a view with _reshape_alias only while no dispatch mode is active); the same input, output and "
            "gradient.")
