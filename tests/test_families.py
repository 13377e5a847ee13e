"""Hugging Face families: node counts per layer, module-aware categories, published sizes, meta = CPU, checkpointing,
the offline guarantee, and your own module (Python API and --model-file)."""

import socket
import textwrap

import pytest
import torch

from graphviz_core.capture.engine import capture_backward
from graphviz_core.cli import main
from graphviz_core.config import PRESETS, config_from_preset
from graphviz_core.models.registry import build_model
from tests.conftest import HF_FAMILIES, captured


def meta(preset: str, **overrides):
    return captured(preset, device="meta", **overrides)


# Nodes one more layer adds (a 2-layer capture minus a 1-layer one, on meta), op by op:
LLAMA_LAYER = (
    9  # AccumulateGrad: 2 RMSNorm weights + q, k, v, o + gate, up, down
    + 2 * 6  # each RMSNorm: Pow, Mean, Add(eps), Rsqrt, Mul(x * rstd), Mul(* weight)
    + 4 * 4  # q, k, v, o projections (no bias): View, T, Mm, UnsafeView
    + 9  # attention reshapes: 5 View + 4 Transpose (q, k, v in; output back)
    + 1  # fused SDPA (grouped-query natively: no repeat of k/v)
    + 2 * 7  # rotary on q and on k: 2 Slice + Neg + Cat (rotate_half), 2 Mul, Add
    + 3 * 4  # gate, up, down projections
    + 2  # SiLU(gate) * up: Silu, Mul
    + 2  # two residual adds
)  # = 77
QWEN2_LAYER = LLAMA_LAYER + 3  # q, k, v carry biases: Addmm, T, View, View instead of 4 nodes, plus 3 bias leaves = 80
MIXTRAL_LAYER = (
    LLAMA_LAYER
    - 17  # no dense SwiGLU MLP: 3 x 4 projection nodes, Silu, Mul, 3 leaves
    + 2  # the sparse MoE block's two Views (flatten tokens, back)
    + 8  # router: leaf, View, T, Mm, Softmax, Topk, Sum, Div (top-k weights renormalised)
    + 17  # experts (grouped mm): 2 leaves, 2 Transpose (the stacked weights as (experts, in, out)), 3 Index (tokens
    # sorted by expert, their routing weights, back to token order), 2 GroupedMm, Split (gate | up), Silu, 2 Mul
    # (gate x up, x routing weight), Unsqueeze, 2 View, Sum (over the k experts)
)  # = 87
GPT2_HF_LAYER = (
    12  # leaves: weight and bias of ln_1, ln_2, c_attn, attn c_proj, c_fc, mlp c_proj
    + 2  # two LayerNorms
    + 4 * 3  # Conv1D layers (c_attn, attn c_proj, c_fc, mlp c_proj): View, Addmm, View
    + 1
    + 9
    + 1  # Split of the fused qkv, 5 View + 4 Transpose, fused SDPA
    + 8  # gelu_new spelled out in NewGELUActivation: 4 Mul, Pow, 2 Add, Tanh
    + 2  # residual adds
)  # = 47
BERT_LAYER = (
    16  # leaves: 6 linear layers x (weight, bias) + 2 LayerNorms x (weight, bias)
    + 6 * 4  # q, k, v, attention out, intermediate, output: View, T, Addmm, View
    + 9
    + 1  # attention reshapes and the fused kernel
    + 1  # GELU
    + 2
    + 2  # post-LN: residual add then LayerNorm, twice
)  # = 55
VIT_LAYER = 16 + 6 * 4 + 9 + 1 + 1 + 2 + 2  # as BERT, pre-LN: same op counts = 55


@pytest.mark.parametrize(
    ("family", "per_layer"),
    [
        ("llama", LLAMA_LAYER),
        ("mistral", LLAMA_LAYER),
        ("qwen2", QWEN2_LAYER),
        ("mixtral", MIXTRAL_LAYER),
        ("gpt2-hf", GPT2_HF_LAYER),
        ("bert", BERT_LAYER),
        ("vit", VIT_LAYER),
    ],
)
def test_each_layer_adds_the_nodes_its_ops_make(family, per_layer):
    one, two = meta(f"{family}-tiny", layers=1), meta(f"{family}-tiny", layers=2)
    assert two.summary.nodes - one.summary.nodes == per_layer


def test_llama_tiny_node_count_from_its_parts():
    # 2 layers + embedding (leaf, Embedding) + final RMSNorm (leaf + 6) + lm_head (leaf, View, T, Mm, UnsafeView)
    # + loss (View of the logits, Alias, LogSoftmax, NllLoss): 2 * 77 + 2 + 7 + 5 + 4 = 172
    assert captured("llama-tiny").summary.nodes == 2 * LLAMA_LAYER + 2 + 7 + 5 + 4


def test_resnet_tiny_node_count_from_its_parts():
    # ResNet-18 layout: 8 basic blocks x (2 x (conv, its weight leaf, BN, BN's 2 leaves) + 2 ReLU + residual add)
    # = 8 * 13 = 104, plus 3 downsampling shortcuts (conv + leaf + BN + 2 leaves) = 15, stem (conv + leaf + BN +
    # 2 leaves + ReLU + max-pool) = 7, average pool (a Mean on CPU) + classifier (View, T, Addmm, 2 leaves) + loss
    # (View, LogSoftmax, NllLoss) = 1 + 5 + 3 = 9
    assert captured("resnet-tiny").summary.nodes == 104 + 15 + 7 + 9
    cats = captured("resnet-tiny").summary.by_category
    # 8 * 2 + 3 + 1 = 20 convolutions and as many batch norms; the stem max-pool and the average pool
    assert (cats["conv"], cats["normalization"], cats["pooling"], cats["residual_add"]) == (20, 20, 2, 8)


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_meta_counts_what_cpu_runs(family):
    cpu, dry = captured(f"{family}-tiny"), meta(f"{family}-tiny")
    assert cpu.summary.by_category == dry.summary.by_category
    assert (cpu.flops.forward, cpu.flops.backward) == (dry.flops.forward, dry.flops.backward)
    assert cpu.memory.saved_bytes == dry.memory.saved_bytes
    assert cpu.loss is not None and torch.isfinite(torch.tensor(cpu.loss))
    assert "other" not in cpu.summary.by_category


def ops(capture, category):
    return sorted({d["op"] for _, d in capture.graph.nodes(data=True) if d["category"] == category})


def test_categories_follow_the_module_that_made_the_op():
    llama = captured("llama-tiny")
    cats = llama.summary.by_category
    assert cats["residual_add"] == 2 * 2  # two per pre-norm layer, 2 layers
    # 5 RMSNorms (2 per layer + final) x (Pow, Mean, Add, Rsqrt, Mul, Mul) = 30
    assert cats["normalization"] == 5 * 6
    assert ops(llama, "normalization") == [
        "AddBackward0",
        "MeanBackward1",
        "MulBackward0",
        "PowBackward0",
        "RsqrtBackward0",
    ]
    assert cats["position"] == 2 * 14  # rotary: 7 ops on q and 7 on k per layer
    assert ops(llama, "loss") == ["LogSoftmaxBackward0", "NllLossBackward0"]
    mixtral = captured("mixtral-tiny")
    assert {"TopkBackward0", "SoftmaxBackward0"} <= set(ops(mixtral, "routing"))
    # router per layer: View, T, Softmax, Topk, Sum, Div (its Mm stays matmul) = 6, 2 layers
    assert mixtral.summary.by_category["routing"] == 2 * 6
    # built-in models: the transformer block has 2 residual adds (the third Add is nn.MultiheadAttention's bias add)
    block = captured("transformer-block", batch=1, seq=16)
    assert block.summary.by_category["residual_add"] == 2
    gpt2 = captured("gpt2-tiny")
    assert gpt2.summary.by_category["residual_add"] == 2 * 2  # the token + position sum is embedding
    assert [
        d["category"] for _, d in gpt2.graph.nodes(data=True) if d["op"] == "AddBackward0" and d["module"] == ""
    ] == ["embedding"]
    bert = captured("bert-tiny")
    assert bert.summary.by_category["residual_add"] == 2 * 2  # post-LN: attention and MLP residual per layer
    assert bert.summary.by_category["embedding"] == 3 + 2  # word, position, segment lookups and their 2 sums


def test_grouped_query_attention_keeps_fewer_key_value_bytes_than_full_heads():
    gqa = meta("llama-tiny", kv_heads=1)
    mha = meta("llama-tiny", kv_heads=4)
    assert gqa.summary.parameter_count < mha.summary.parameter_count
    assert gqa.memory.saved_bytes < mha.memory.saved_bytes


def llama_parameters(h, inter, layers, heads, kv, vocab, tied):
    head = h // heads
    layer = h * h + 2 * h * kv * head + h * h + 3 * h * inter + 2 * h  # q, k, v, o, SwiGLU, 2 RMSNorm weights
    return vocab * h * (1 if tied else 2) + layers * layer + h


@pytest.mark.parametrize(
    ("preset", "published"),
    [
        # Llama model cards' exact counts, which the formula above reproduces:
        ("llama-3.2-1b", 1_235_814_400),  # 128256*2048 (tied) + 16*60_821_504 + 2048
        ("llama-3.1-8b", 8_030_261_248),  # 2*128256*4096 + 32*218_112_000 + 4096
        ("llama-3.1-70b", 70_553_706_496),  # 2*128256*8192 + 80*855_654_400 + 8192
        ("llama-3.1-405b", 405_853_388_800),  # 2*128256*16384 + 126*3_187_703_808 + 16384
    ],
)
def test_llama_presets_have_the_published_parameter_count(preset, published):
    c = config_from_preset(preset)
    assert llama_parameters(c.hidden, c.intermediate, c.layers, c.heads, c.kv_heads, c.vocab, c.tied) == published
    with torch.device("meta"):
        model = build_model(c)
    assert sum(p.numel() for p in model.parameters()) == published


@pytest.mark.parametrize(
    ("preset", "published", "tolerance"),
    [
        ("mistral-7b", 7.25e9, 0.005),
        ("qwen2.5-7b", 7.62e9, 0.005),
        ("mixtral-8x7b", 46.7e9, 0.005),
        ("gpt2-hf-small", 124e6, 0.005),
        ("gpt2-hf-medium", 355e6, 0.005),
        ("gpt2-hf-large", 774e6, 0.005),
        ("gpt2-hf-xl", 1.558e9, 0.005),
        ("bert-base", 110e6, 0.01),
        ("vit-base", 86.6e6, 0.005),
        ("resnet-50", 25.6e6, 0.005),
    ],
)
def test_other_presets_match_their_published_size(preset, published, tolerance):
    with torch.device("meta"):
        model = build_model(config_from_preset(preset))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(published, rel=tolerance)


def test_capture_reports_the_parameter_count_it_reached():
    # Llama 3.1 8B's shape cut to 2 layers at s=128: 2*128256*4096 + 2*218_112_000 + 4096 = 1_486_901_248
    capture = meta("llama-3.1-8b", layers=2, seq=128)
    assert capture.summary.parameter_count == 1_486_901_248


@pytest.mark.parametrize("checkpoint", ["full", "selective"])
@pytest.mark.parametrize("family", ["llama", "bert", "resnet"])
def test_checkpointing_works_for_transformers_families(family, checkpoint):
    plain, ckpt = captured(f"{family}-tiny"), captured(f"{family}-tiny", checkpoint=checkpoint)
    assert ckpt.loss == pytest.approx(plain.loss)
    assert ckpt.memory.saved_bytes < plain.memory.saved_bytes
    assert ckpt.memory.checkpoint_held_bytes > 0
    assert ckpt.flops.backward_recompute > 0
    if checkpoint == "selective":  # keeps matmul outputs: holds more than full, recomputes less
        full = captured(f"{family}-tiny", checkpoint="full")
        assert ckpt.memory.checkpoint_held_bytes > full.memory.checkpoint_held_bytes
        assert ckpt.flops.backward_recompute < full.flops.backward_recompute


def test_selective_checkpointing_recomputes_only_what_it_does_not_keep():
    # llama-tiny: T = b*s = 2*32 = 64 tokens, h = 64, 4 query heads of 16, 2 key-value heads (32 wide), I = 128.
    # Per layer the kept ops' forward FLOPs (2 FLOPs per multiply-add):
    #   q, o projections 2 * 2*T*h*h = 1,048,576; k, v 2 * 2*T*h*32 = 524,288; gate, up, down 3 * 2*T*h*I
    #   = 3,145,728; attention (dense count) 4*b*heads*s*s*16 = 524,288  -> 5,242,880, two layers 10,485,760.
    # Full checkpointing recomputes all of that except down_proj (the non-reentrant early stop: nothing saved
    # after it is needed, 2*T*I*h = 1,048,576 per layer); selective keeps those outputs, so the difference in
    # recompute is exactly the kept ops minus the early-stopped ones.
    plain = captured("llama-tiny")
    full, selective = (captured("llama-tiny", checkpoint=c) for c in ("full", "selective"))
    assert full.flops.backward_recompute - selective.flops.backward_recompute == 10_485_760 - 2 * 1_048_576
    # The policy's shape-only copies of the kept ops are not forward work (they once counted 10.5 MFLOP twice).
    assert selective.flops.forward == full.flops.forward == plain.flops.forward


def test_eager_attention_keeps_the_scores_and_repeats_key_values():
    eager = captured("llama-tiny", attention="eager")
    # no fused kernel: the core op by op, each of its ops attention: per layer q@kᵀ and att@v (2 bmm), the scale
    # (mul), the causal mask (add), softmax = 5, x 2 layers
    assert eager.summary.by_category["attention"] == 5 * 2
    assert eager.memory.saved_bytes > captured("llama-tiny").memory.saved_bytes


def test_no_preset_contacts_the_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    for name in PRESETS:
        with torch.device("meta"):
            build_model(config_from_preset(name))
    assert capture_backward(config_from_preset("llama-tiny", device="meta")).summary.nodes > 0


def test_your_own_module_through_the_python_api():
    from graphviz_core.capture.own_module import capture_module

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    capture = capture_module(model, torch.randn(4, 8), lambda out: out.pow(2).mean(), name="two-layer net")
    # 2 Linear (Addmm, T, 2 leaves) + ReLU + Pow + Mean = 2 * 4 + 3 = 11
    assert capture.summary.nodes == 11
    assert capture.summary.parameter_count == 8 * 16 + 16 + 16 + 1
    assert capture.config.model == "custom" and capture.loss is not None


FACTORY = """
import torch

def make():
    model = torch.nn.Linear(4, 2)
    return model, torch.randn(3, 4), lambda out: out.sum()

def broken():
    raise RuntimeError("no weights here")

def wrong():
    return 42

def not_scalar():
    return torch.nn.Linear(4, 2), torch.randn(3, 4), lambda out: out
"""


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("broken", "broken() raised RuntimeError: no weights here"),
        ("wrong", "must return (module, example inputs, loss function), got int"),
        ("not_scalar", "the loss must be a scalar tensor with a grad_fn, got a tensor of shape (3, 2)"),
        ("missing", "has no function 'missing'"),
    ],
)
def test_model_file_bad_input_is_one_line(tmp_path, capsys, factory, message):
    path = tmp_path / "net.py"
    path.write_text(textwrap.dedent(FACTORY))
    assert main(["graph", "--model-file", f"{path}:{factory}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_model_file_captures_and_a_missing_file_is_refused(tmp_path, capsys):
    import json

    path = tmp_path / "net.py"
    path.write_text(textwrap.dedent(FACTORY))
    assert main(["graph", "--model-file", f"{path}:make"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["parameter_count"] == 4 * 2 + 2
    assert main(["graph", "--model-file", f"{tmp_path}/nope.py:make"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "derived"),
    [
        # llama-tiny, s=32, b=2 (sb = 64), h=64, a=4, kv width 2*16 = 32, I=128; float32: e = f = 4.
        # norms 2*((f + 2e)*sb*h + f*sb) = 2*(12*4096 + 256) = 98_816; attention q 4*4096 + k,v 2*4*64*32 + out
        # 4*4096 + lse 4*4*64 = 50_176; SwiGLU 4*4*64*128 = 131_072: 280_064
        ({}, 280_064),
        # bfloat16, eager: norms 2*((4 + 4)*4096 + 256) = 66_048; q, k, v at all heads 3*2*4096 = 24_576, softmax
        # float32 and bf16 copy (4 + 2)*4*32*32*2 = 49_152, o_proj input 2*4096 = 8_192; SwiGLU 4*2*64*128 = 65_536
        ({"dtype": "bfloat16", "attention": "eager"}, 66_048 + 24_576 + 49_152 + 8_192 + 65_536),
    ],
)
def test_llama_layer_bytes_match_the_derivation(overrides, derived):
    from graphviz_core.analysis.textbook import memory_per_layer

    rows = memory_per_layer(captured("llama-tiny", **overrides))
    assert (rows[0].textbook, rows[0].measured) == (derived, derived)
    # without the float32 upcast each of the 2 norms keeps f*sbh = 4*4096 bytes less
    assert rows[0].textbook - rows[1].textbook == 2 * 4 * 4096


def test_every_category_has_a_colour_and_layers_group_by_index():
    from graphviz_core.export.formats import CATEGORY_COLOURS
    from graphviz_core.graph.categories import CATEGORIES
    from graphviz_core.graph.views import module_groups

    assert set(CATEGORIES) <= set(CATEGORY_COLOURS)
    # transformers paths: each decoder layer is its own group (model.layers.N), not one "model.layers"
    groups = module_groups(captured("llama-tiny").graph)
    assert groups == ["lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]


def test_tied_embeddings_flag_removes_the_output_matrix(capsys):
    import json

    # llama-tiny tied: 139_584 - V*h = 139_584 - 512*64 = 106_816 parameters
    assert main(["graph", "--model", "llama", "--tied", "--device", "meta"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["parameter_count"] == 139_584 - 512 * 64
    assert main(["graph", "--model", "gpt2", "--tied"]) == 2
    assert "has no choice of tied embeddings" in capsys.readouterr().err


def test_rule_of_thumb_counts_vit_patches_as_tokens():
    from graphviz_core.analysis.flop_analysis import rule_of_thumb

    vit = rule_of_thumb(captured("vit-tiny"))
    # 32-pixel images in 16-pixel patches: (32/16)^2 + 1 class token = 5 tokens per image, batch 2
    assert vit.tokens == 2 * 5
    assert vit.measured_flop == vit.rule_flop + sum(t.flop for t in vit.gap)
    assert rule_of_thumb(captured("resnet-tiny")).attention_flop == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixtral_experts_keep_token_rows_not_copies_of_their_weights(dtype):
    """The experts run as grouped matmuls (torch._grouped_mm), as training does: each GroupedMm node keeps the routed
    token rows (64 tokens x 2 experts each = 128 rows) and the stacked weight itself, a parameter, never counted. The
    batched-matmul form this replaced kept every token's gathered weight copies: 25.1 MiB saved on mixtral-tiny, and
    2.7 TiB per layer on Mixtral-8x7B at s=4096. A float32 dry run answers the grouped matmul itself (the meta kernel
    refuses float32), so meta still counts what the CPU runs."""
    cpu = captured("mixtral-tiny", dtype=dtype)
    dry = meta("mixtral-tiny", dtype=dtype)
    grouped = [d for _, d in cpu.graph.nodes(data=True) if d["op"] == "GroupedMmBackward0"]
    assert len(grouped) == 2 * 2 and {d["category"] for d in grouped} == {"matmul"}  # gate|up and down, 2 layers
    for d in grouped:
        rows = [s for s in d["saved"] if not s["parameter"] and len(s["shape"]) == 2]
        assert rows and all(s["shape"][0] == 64 * 2 for s in rows)
        assert [s["shape"] for s in d["saved"] if s["parameter"]] in ([[4, 64, 256]], [[4, 128, 64]])
    assert cpu.memory.saved_bytes == dry.memory.saved_bytes < 2 * 2**20
    assert cpu.summary.by_op == dry.summary.by_op


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_each_tiny_transformers_preset_builds_without_a_warning(family, caplog):
    """transformers warns of a config that contradicts itself; a built-in preset must not give one. gpt2-hf-tiny once
    did, twice on every build: "bos_token_id must be `None` or an integer within the vocabulary (between 0 and 511),
    got 50256" (GPT2Config keeps GPT-2's end-of-text id, 50,256 = the last of its 50,257 tokens, for any
    vocabulary), and the same for eos_token_id."""
    import logging

    with caplog.at_level(logging.WARNING, logger="transformers"):
        build_model(config_from_preset(f"{family}-tiny", device="meta"))
    assert [r.getMessage() for r in caplog.records if r.name.startswith("transformers")] == []
