"""Every op of a spelled-out attention core is `attention` (graph/categories.py): q·kᵀ, scale, mask, softmax,
dropout and ·v, for every family whose attention can run op by op (`manual` for the built-in models, `eager` for the
transformers families); the projections stay `matmul`, views `shape`, rotary `position`."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from graphviz_core.config import resolve_config
from graphviz_core.graph.categories import category_in_module
from graphviz_core.models.registry import build_model
from tests.conftest import captured

# Per layer, the ops the unfused core runs that autograd records (dropout at p=0 records none):
#   q·kᵀ (bmm), scale (mul), [mask], softmax, ·v (bmm)
CAUSAL_MASKED_FILL = {"BmmBackward0": 2, "MulBackward0": 1, "MaskedFillBackward0": 1, "SoftmaxBackward0": 1}  # 5
CAUSAL_MASK_ADDED = {"BmmBackward0": 2, "MulBackward0": 1, "AddBackward0": 1, "SoftmaxBackward0": 1}  # 5
NO_MASK = {"BmmBackward0": 2, "MulBackward0": 1, "SoftmaxBackward0": 1}  # 4: encoders given no padding mask

SPELLED_OUT = [
    # (preset or model, attention, per-layer core ops): the built-in GPT-2 masks with masked_fill, the built-in
    # block is an encoder (no mask); transformers' decoders add the causal mask to the scores; BERT and ViT
    # get no padding mask.
    ("gpt2-tiny", "manual", CAUSAL_MASKED_FILL),
    ("block", "manual", NO_MASK),
    ("llama-tiny", "eager", CAUSAL_MASK_ADDED),
    ("mistral-tiny", "eager", CAUSAL_MASK_ADDED),
    ("qwen2-tiny", "eager", CAUSAL_MASK_ADDED),
    ("mixtral-tiny", "eager", CAUSAL_MASK_ADDED),
    ("gemma3-tiny", "eager", CAUSAL_MASK_ADDED),
    ("gpt2-hf-tiny", "eager", CAUSAL_MASK_ADDED),
    ("bert-tiny", "eager", NO_MASK),
    ("vit-tiny", "eager", NO_MASK),
]


def _capture(name: str, attention: str):
    if name == "block":  # the family's default shape: 1 layer, h=64, 4 heads
        from graphviz_core.capture.engine import capture_backward

        return capture_backward(resolve_config(model="block", attention=attention, device="cpu"))
    return captured(name, attention=attention)


def _attention_module_paths(config) -> set[str]:
    """Paths of the modules whose own ops are an attention core, by their type (built on meta: no memory)."""
    with torch.device("meta"):
        model = build_model(config.replace(device="meta"))
    return {path for path, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and type(m).__name__ != "MultiheadAttention"}


@pytest.mark.parametrize(("name", "attention", "per_layer"), SPELLED_OUT, ids=[f"{n}-{a}" for n, a, _ in SPELLED_OUT])
def test_every_op_of_the_spelled_out_core_is_attention(name, attention, per_layer):
    capture = _capture(name, attention)
    layers = capture.config.layers
    graph = capture.graph
    attention_ops = Counter(d["op"] for _, d in graph.nodes(data=True) if d["category"] == "attention")
    assert dict(attention_ops) == {op: n * layers for op, n in per_layer.items()}
    assert capture.summary.by_category["attention"] == sum(per_layer.values()) * layers
    # No op of the core lands elsewhere: what the attention modules compute themselves is attention, or a view /
    # reshape (shape); their projections and norms are children and keep their own categories.
    cores = _attention_module_paths(capture.config)
    assert cores
    in_cores = Counter(d["category"] for _, d in graph.nodes(data=True) if d["module"] in cores)
    assert set(in_cores) <= {"attention", "shape"}, in_cores
    assert in_cores["attention"] == sum(per_layer.values()) * layers
    children = {d["category"] for _, d in graph.nodes(data=True)
                if d["module"].rpartition(".")[0] in cores and d["op"] in ("MmBackward0", "AddmmBackward0")}
    assert children == {"matmul"}  # q/k/v/o projections (Linear, Conv1D) stay matmul


def test_fused_kernels_are_one_attention_node_per_layer_and_mha_keeps_its_in_projection_a_matmul():
    for name in ("gpt2-tiny", "llama-tiny", "vit-tiny"):
        capture = captured(name)
        assert capture.summary.by_category["attention"] == capture.config.layers  # one SDPA backward node per layer
    mha = captured("gpt2-tiny", attention="mha")
    assert mha.summary.by_category["attention"] == 2
    own = Counter((d["op"], d["category"]) for _, d in mha.graph.nodes(data=True) if d["module"] == "blocks.0.attn.mha")
    # nn.MultiheadAttention computes its packed q, k, v in-projection itself (x @ W_in + b): a matmul, not attention
    assert own[("AddBackward0", "matmul")] == 1
    assert {cat for (_, cat) in own} <= {"matmul", "shape", "attention", "accumulate_grad"}  # + in_proj_weight, _bias
    assert own[("ScaledDotProductFlashAttentionForCpuBackward0", "attention")] == 1


@pytest.mark.parametrize(
    ("op", "module_type", "category"),
    [
        ("BmmBackward0", "CoreAttention", "attention"),  # q·kᵀ in the built-in core
        ("SoftmaxBackward0", "LlamaAttention", "attention"),
        ("AddBackward0", "Qwen2Attention", "attention"),  # the causal mask added to the scores
        ("MaskedFillBackward0", "CoreAttention", "attention"),
        ("MulBackward0", "BertSelfAttention", "attention"),  # the 1/sqrt(d) scale
        ("NativeDropoutBackward0", "GPT2Attention", "attention"),
        ("ViewBackward0", "LlamaAttention", "shape"),
        ("ExpandBackward0", "MistralAttention", "shape"),  # repeat_kv
        ("ToCopyBackward0", "LlamaAttention", "conversion"),  # the float32 softmax's cast back
        ("MulBackward0", "ApplyRotary", "position"),
        ("MmBackward0", "Linear", "matmul"),  # q_proj, o_proj
        ("AddmmBackward0", "Conv1D", "matmul"),  # GPT-2's c_attn
        ("AddmmBackward0", "MultiheadAttention", "matmul"),  # its own in-projection
        ("AddBackward0", "MultiheadAttention", "matmul"),  # its bias add
        ("MulBackward0", "Gemma3RMSNorm", "normalization"),  # q_norm / k_norm
    ],
)
def test_category_in_an_attention_module_is_a_lookup(op, module_type, category):
    assert category_in_module(op, module_type) == category


def test_the_graph_page_counts_the_spelled_out_core_beside_the_fused_kernels_one_node():
    from graphviz_core.ui.summary import spelled_out_attention_note

    note = spelled_out_attention_note(captured("llama-tiny", attention="eager"))
    # 2 bmm + mul + add + softmax = 5 per layer
    assert note.startswith("Attention spelled out (eager): 5 attention nodes per layer, 2 × BmmBackward0 (q·kᵀ, ·v)")
    assert "AddBackward0 (mask)" in note and "MulBackward0 (scale)" in note and "SoftmaxBackward0 (softmax)" in note
    assert "the fused kernel (sdpa) is one node per layer" in note
    assert spelled_out_attention_note(captured("llama-tiny")) is None  # fused: its one node says it all


def test_the_explorer_shows_the_note_under_the_category_table():
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from tests.conftest import plain

    app = str(Path(__file__).resolve().parent.parent / "app.py")
    at = AppTest.from_file(app, default_timeout=120).run()
    at.selectbox(key="config.attention").set_value("manual")
    next(b for b in at.button if b.label == "Run backward pass").click().run()
    assert not at.exception
    captions = [plain(c.value) for c in at.caption]
    # gpt2-tiny manual: 2 bmm + mul + masked_fill + softmax = 5 per layer
    assert any(c.startswith("Attention spelled out (manual): 5 attention nodes per layer") for c in captions), captions
