"""The graph's notes say which nodes a run without the capture's dispatch mode names otherwise
(graphviz_core.capture.plain_names): the mode makes ATen's reshape take `view` where a plain run takes `_reshape_alias`,
so ReshapeAliasBackward0 nodes read ViewBackward0 under the capture."""

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


def test_the_notes_count_the_nodes_a_plain_run_names_reshapealias():
    for preset, reshapes in (("llama-tiny", 2), ("gemma3-tiny", 6)):
        config = config_from_preset(preset, device="cpu")
        capture = capture_backward(config)
        ops = Counter(d["op"] for _, d in capture.graph.nodes(data=True))
        plain, loss = plain_run(config)
        # one per layer: attention's output, transposed back to (batch, seq, heads, head_dim), reshaped to
        # (batch, seq, hidden): a view of a non-contiguous tensor (llama-tiny 2 layers, gemma3-tiny 6)
        assert plain["ReshapeAliasBackward0"] == reshapes and ops["ReshapeAliasBackward0"] == 0, preset
        # the capture names them ViewBackward0; every other op's count is the plain run's
        assert ops["ViewBackward0"] == plain["ViewBackward0"] + reshapes, preset
        assert +(ops - Counter({"ViewBackward0": reshapes})) == +(plain - Counter({"ReshapeAliasBackward0": reshapes}))
        (note,) = [n for n in capture.notes if "ReshapeAliasBackward0" in n]
        assert note.startswith(f"{reshapes} ViewBackward0 node(s) here view a non-contiguous tensor"), preset
        assert capture.loss == loss  # no extra run: the same batch, weights and loss as a plain run


def test_a_dry_run_says_which_views_a_plain_run_may_name_otherwise():
    capture = capture_backward(config_from_preset("llama-tiny", device="meta"))
    (note,) = [n for n in capture.notes if "ReshapeAliasBackward0" in n]
    # the two views of a non-contiguous tensor are the two reshapes the CPU run above names ReshapeAliasBackward0
    assert note.startswith("2 ViewBackward0 node(s) here view a non-contiguous tensor")
    assert "dispatch mode" in note
