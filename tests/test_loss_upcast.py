"""The transformers families' language-model loss copies 16-bit logits to float32 first, as transformers' own
ForCausalLMLoss and ForMaskedLMLoss do; its image classifiers' loss and autocast's cross-entropy do not need it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import captured
from torch.autograd.graph import saved_tensors_hooks
from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss, ForSequenceClassificationLoss

from graphviz_core.config import config_from_preset
from graphviz_core.models.registry import compute_loss

B, S, V = 2, 32, 512  # llama-tiny's batch, sequence and vocabulary


def loss_and_saves(fn, logits: torch.Tensor):
    """fn(logits)'s loss, the (dtype, elements) of every tensor autograd saved for it, the logits' gradient and the
    op names of its backward graph (a next_functions walk)."""
    saved: list[tuple[torch.dtype, int]] = []

    def pack(tensor):
        saved.append((tensor.dtype, tensor.numel()))
        return tensor

    leaf = logits.detach().requires_grad_()
    with saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = fn(leaf * 1)  # the head's output is a non-leaf, as in the model (a scalar product saves nothing)
    ops, todo = [], [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None:
            ops.append(type(node).__name__)
            todo += [child for child, _ in node.next_functions]
    loss.backward()
    return loss, saved, leaf.grad, ops


def random_logits(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=gen).to(dtype), torch.randint(shape[-1], shape[:-1], generator=gen)


@pytest.mark.parametrize("preset, theirs", [("llama-tiny", "causal"), ("gpt2-hf-tiny", "causal"), ("bert-tiny", "masked")])
def test_the_loss_of_bf16_logits_is_transformers_own_loss(preset, theirs):
    config = config_from_preset(preset, dtype="bfloat16")
    logits, targets = random_logits((B, S, V), torch.bfloat16)
    ours = loss_and_saves(lambda out: compute_loss(config, SimpleNamespace(logits=out), targets), logits)
    if theirs == "causal":  # shift_labels given: transformers does not shift (our targets are already the next tokens)
        reference = loss_and_saves(lambda out: ForCausalLMLoss(out, targets, V, shift_labels=targets), logits)
    else:
        reference = loss_and_saves(lambda out: ForMaskedLMLoss(out, targets, V), logits)
    assert ours[0].dtype == torch.float32 and torch.equal(ours[0], reference[0])
    assert torch.equal(ours[2], reference[2]) and ours[2].dtype == torch.bfloat16  # the gradient the head receives
    # what autograd keeps: the float32 log-softmax, one per logit (b*s*V = 32,768 x 4 B = 131,072 B), and the targets;
    # transformers' flatten-with-view keeps nothing more, nor does ours
    assert ours[1] == reference[1]
    assert (torch.float32, B * S * V) in ours[1] and not any(dtype == torch.bfloat16 for dtype, _ in ours[1])
    assert ours[3].count("ToCopyBackward0") == 1  # the one float32 copy of the logits


def test_an_image_classifier_keeps_its_logits_dtype_as_transformers_does():
    config = config_from_preset("vit-tiny", dtype="bfloat16")
    logits, labels = random_logits((B, 10), torch.bfloat16)  # vit-tiny: 10 classes
    ours = loss_and_saves(lambda out: compute_loss(config, SimpleNamespace(logits=out), labels), logits)
    hf_config = SimpleNamespace(num_labels=10, problem_type=None)
    reference = loss_and_saves(lambda out: ForSequenceClassificationLoss(labels, out, hf_config), logits)
    assert ours[0].dtype == torch.bfloat16 and torch.equal(ours[0], reference[0])
    assert (torch.bfloat16, B * 10) in ours[1] and "ToCopyBackward0" not in ours[3]


def test_float32_logits_and_autocast_get_no_extra_copy():
    config = config_from_preset("llama-tiny")
    logits, targets = random_logits((B, S, V), torch.float32)
    ours = loss_and_saves(lambda out: compute_loss(config, SimpleNamespace(logits=out), targets), logits)
    assert "ToCopyBackward0" not in ours[3]  # .float() of a float32 tensor is the tensor itself
    # under autocast cross_entropy is on the float32 list: autocast casts the flattened bf16 logits itself, and the loss
    # leaves that cast where it is (one ToCopy after the view, the same saves as a plain cross-entropy)
    logits, targets = random_logits((B, S, V), torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = loss_and_saves(lambda out: compute_loss(config, SimpleNamespace(logits=out), targets), logits)
        plain = loss_and_saves(lambda out: F.cross_entropy(out.reshape(-1, V), targets.reshape(-1)), logits)
    assert ours[3] == plain[3] and ours[1] == plain[1] and torch.equal(ours[0], plain[0])
    assert ours[3][:4] == ["NllLossBackward0", "LogSoftmaxBackward0", "ToCopyBackward0", "ViewBackward0"]


def test_a_bf16_capture_holds_the_float32_log_softmax_and_the_copy_outside_every_module():
    capture = captured("llama-tiny", dtype="bfloat16", device="cpu")
    first = [capture.graph.nodes[n] for n in capture.backward_order[:5]]
    assert [n["op"] for n in first] == ["NllLossBackward0", "LogSoftmaxBackward0", "ViewBackward0", "ToCopyBackward0",
                                        "UnsafeViewBackward0"]
    assert first[1]["saved_bytes"] == B * S * V * 4 == 131_072  # the log-softmax in float32 (bf16: 65,536)
    assert (first[3]["category"], first[3]["module"], first[4]["module"]) == ("conversion", "", "lm_head")
