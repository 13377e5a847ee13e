"""Categorising a node is a pure lookup; every op the shipped presets produce has a real category."""

import pytest

from graphviz_core.graph.categories import CATEGORIES, category_of, normalise_op
from tests.conftest import captured


@pytest.mark.parametrize(
    ("op", "category"),
    [
        ("AddmmBackward0", "matmul"),
        ("BmmBackward0", "matmul"),
        ("ScaledDotProductEfficientAttentionBackward0", "attention"),
        ("ScaledDotProductFlashAttentionForCpuBackward0", "attention"),
        ("NativeLayerNormBackward0", "normalization"),
        ("LogSoftmaxBackward0", "normalization"),
        ("GeluBackward0", "activation"),
        ("MulBackward0", "elementwise"),
        ("AddBackward0", "residual_add"),
        ("SumBackward1", "reduction"),
        ("NllLossBackward0", "loss"),
        ("EmbeddingBackward0", "embedding"),
        ("ViewBackward0", "shape"),
        ("TBackward0", "shape"),
        ("ToCopyBackward0", "conversion"),
        ("AccumulateGrad", "accumulate_grad"),
        ("SomethingNewBackward0", "other"),
    ],
)
def test_category_of(op, category):
    assert category_of(op) == category


def test_normalise_strips_the_namespace():
    assert normalise_op("torch::autograd::AccumulateGrad") == "AccumulateGrad"
    assert normalise_op("AddmmBackward0") == "AddmmBackward0"


PRESET_RUNS = [
    ("gpt2-tiny", {}),
    ("mlp", {}),
    ("transformer-block", {"batch": 1, "seq": 16}),
    ("gpt2-small", {"device": "meta"}),
    ("llama-3.1-70b", {"layers": 2}),  # same ops per layer as 80; meta either way
    *[("gpt2-tiny", {"attention": a, "checkpoint": c}) for a in ("sdpa", "mha", "manual") for c in ("none", "full", "selective")],
    ("gpt2-tiny", {"dtype": "bfloat16"}),
    ("mlp", {"checkpoint": "full"}),
]


@pytest.mark.parametrize(("preset", "overrides"), PRESET_RUNS)
def test_every_op_from_the_presets_has_a_category(preset, overrides):
    capture = captured(preset, **overrides)
    uncategorised = sorted({d["op"] for _, d in capture.graph.nodes(data=True) if d["category"] == "other"})
    assert uncategorised == []
    assert set(capture.summary.by_category) <= set(CATEGORIES)
