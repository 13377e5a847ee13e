"""The op names the user's own run gives, where the capture's dispatch mode changes them.

The capture watches every aten op through one TorchDispatchMode (graphviz_core.capture.engine). While any dispatch mode
is active, ATen's `reshape` treats every tensor as a subclass (`at::isTensorSubclassLike`) and makes a view that
needs no copy with `view` instead of `_reshape_alias`: the node autograd records is then `ViewBackward0` where a
plain run records `ReshapeAliasBackward0`. Nothing else about it differs (the same input, output, saved sizes and
gradient). Llama has 3 such nodes, Gemma 3 6; the shipped models show no other difference.

On a real device the capture runs the forward once more before the measured step, with no mode and no hook, walks
its graph in the same order and takes each node's name from it (`plain_op_names`); the measured step's figures are
untouched (the random state is forked, the buffers restored, and the graph is freed before the measured forward). On
`meta` (the dry run's kernels are the mode's own) the candidates are counted instead (`ReshapeViews`: the views of a
non-contiguous input, known by autograd's sequence number) and the graph's notes say what differs and why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from graphviz_core.capture.walk import autograd_nodes, next_sequence_nr
from graphviz_core.graph.categories import normalise_op

VIEW = torch.ops.aten.view.default
RENAMED = ("ViewBackward0", "ReshapeAliasBackward0")  # (under the capture's mode, in a plain run)


class ReshapeViews:
    """In the forward's dispatch mode: the sequence numbers of the ViewBackward0 nodes made from a non-contiguous
    input, the ones a plain run may name ReshapeAliasBackward0 (when `reshape` made them)."""

    def __init__(self) -> None:
        self.sequence_nrs: set[int] = set()

    def observe(self, func, args, kwargs, out) -> None:
        if func is VIEW and isinstance(args[0], torch.Tensor) and args[0].requires_grad \
                and not args[0].is_contiguous():
            self.sequence_nrs.add(next_sequence_nr() - 1)  # autograd made the view's node before dispatching here


def plain_op_names(model: torch.nn.Module, inputs: tuple, loss_of: Callable,
                   autocast: contextlib.AbstractContextManager) -> list[str] | None:
    """The normalised op name of every node a forward with no mode and no hook makes, in the walk's pre-order from
    the loss; None if that forward fails. The random state is forked (dropout draws the same masks in the measured
    step) and the buffers (BatchNorm's running statistics) are put back as they were."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), autocast:
            loss = loss_of(model(*inputs))
            names = [normalise_op(node.name()) for node in autograd_nodes(loss.grad_fn)]
        del loss
        return names
    except Exception:  # noqa: BLE001 - the capture's own forward says what is wrong; names stay the mode's
        return None
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


def renamed(ops: list[str], plain: list[str] | None) -> dict[int, str] | None:
    """{position: the plain run's name} where it differs from the capture's, if the two walks align node for node (a
    float16 GradScaler's scaling adds one node at the root of the capture's); None where they do not."""
    if plain is None or len(ops) - len(plain) not in (0, 1):
        return None
    offset = len(ops) - len(plain)
    changes = {i + offset: b for i, (a, b) in enumerate(zip(ops[offset:], plain, strict=True)) if a != b}
    return changes if all((ops[i], name) == RENAMED for i, name in changes.items()) else None


def note(candidates: int) -> str:
    """The graph's note where the plain names are not known (a dry run, or a plain run that did not align)."""
    return (f"{candidates:,} ViewBackward0 node(s) here view a non-contiguous tensor: where the model called reshape "
            "there, a run without this capture's dispatch mode records ReshapeAliasBackward0 instead (ATen's reshape "
            "makes a view with _reshape_alias only while no dispatch mode is active); the same input, output and "
            "gradient.")
