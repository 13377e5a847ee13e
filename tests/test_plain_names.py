"""The graph names each node as the user's own run does (graphviz_core.capture.plain_names): the capture's dispatch
mode makes ATen's reshape take `view` where a plain run takes `_reshape_alias`, so ReshapeAliasBackward0 nodes read
ViewBackward0 under the capture."""

from __future__ import annotations

from collections import Counter

import torch

from graphviz_core.capture.engine import capture_backward
from graphviz_core.capture.walk import autograd_nodes
from graphviz_core.config import config_from_preset
from graphviz_core.graph.categories import normalise_op
from graphviz_core.models.registry import build_model, compute_loss, make_batch


def plain_run(config) -> tuple[Counter, float]:
    """The op of every node, and the loss, of the same step run here with nothing watching it."""
    torch.manual_seed(config.seed)
    model, batch = build_model(config), make_batch(config, "cpu")
    loss = compute_loss(config, model(batch.inputs), batch.targets)
    return Counter(normalise_op(n.name()) for n in autograd_nodes(loss.grad_fn)), float(loss.detach())


def test_the_graph_has_the_op_names_a_plain_run_has():
    for preset, reshapes in (("llama-tiny", 2), ("gemma3-tiny", 6)):
        config = config_from_preset(preset, device="cpu")
        capture = capture_backward(config)
        ops = Counter(d["op"] for _, d in capture.graph.nodes(data=True))
        plain, loss = plain_run(config)
        # one per layer: attention's output, transposed back to (batch, seq, heads, head_dim), reshaped to
        # (batch, seq, hidden): a view of a non-contiguous tensor (llama-tiny 2 layers, gemma3-tiny 6). Before: 0
        # here, each of them ViewBackward0
        assert ops == plain and plain["ReshapeAliasBackward0"] == reshapes, preset
        assert capture.loss == loss  # the step measured is the one it was: same batch, same weights, same loss
        assert not any("ReshapeAliasBackward0" in note for note in capture.notes)  # nothing left to explain


def test_a_dry_run_says_which_views_a_plain_run_may_name_otherwise():
    capture = capture_backward(config_from_preset("llama-tiny", device="meta"))
    (note,) = [n for n in capture.notes if "ReshapeAliasBackward0" in n]
    # the two views of a non-contiguous tensor are the two reshapes the CPU run above names ReshapeAliasBackward0
    assert note.startswith("2 ViewBackward0 node(s) here view a non-contiguous tensor")
    assert "dispatch mode" in note


def test_the_plain_run_leaves_the_measured_step_as_it_was():
    """The extra forward forks the random state and puts BatchNorm's running statistics back: a dropout mask or a
    buffer it touched would change what the measured step computes."""
    from graphviz_core.capture import plain_names

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5))
    x = torch.randn(16, 4).t().contiguous().t()  # a non-contiguous input, as a reshape's would be
    before_state, before_mean = torch.get_rng_state(), model[1].running_mean.clone()
    names = plain_names.plain_op_names(model, (x,), lambda out: out.reshape(-1).sum(), torch.autocast("cpu", enabled=False))
    assert names[0] == "SumBackward0" and "NativeBatchNormBackward0" in names
    assert torch.equal(torch.get_rng_state(), before_state) and torch.equal(model[1].running_mean, before_mean)
