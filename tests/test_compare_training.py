"""The compare page's training-step pairs: each pair's sentence (compare_reasons → compare_training) checked against
numbers counted here without the capture: a next_functions walk, saved_tensors_hooks, torch.optim's own state, a
torch.compile of our own. llama-tiny: hidden 64, 4 heads, 2 key-value heads (k, v 64 → 32), MLP 128, 2 layers,
vocabulary 512, batch 2 x seq 32 = 64 tokens. gpt2-tiny: hidden 64, 2 layers, vocabulary 512, b=2, s=32."""

from __future__ import annotations

import json
import re

import pytest
import torch

from graphviz_core.analysis.compare import compare_captures
from graphviz_core.cli import main
from graphviz_core.config import config_from_preset
from graphviz_core.models.registry import build_model, compute_loss, make_batch
from tests.conftest import captured
from tests.test_autocast import TENSORS, P, _independent_run, _walk
from tests.test_finetune import LAYER_LINEARS, LAYERS, TARGETS, TOKENS, R, accumulate_grad_walk
from tests.test_optimizer_choice import _state_after_a_step


def _sentence(a, b) -> str:
    (sentence,) = compare_captures(a, b).explanations  # one field changed: one sentence, with the totals
    return sentence


def test_fp32_vs_bf16_autocast_sentence_counts_casts_and_bytes_by_dtype():
    sentence = _sentence(captured("llama-tiny", device="cpu"), captured("llama-tiny", device="cpu", autocast="bfloat16"))
    _, loss, saved = _independent_run(autocast=True)
    _, fp32_loss, fp32_saved = _independent_run(autocast=False)
    to_copy = [n for n in _walk(loss.grad_fn) if n.name() == "ToCopyBackward0"]
    fp32_to_copy = [n for n in _walk(fp32_loss.grad_fn) if n.name() == "ToCopyBackward0"]
    weight_casts = [n for n in to_copy if n.next_functions[0][0].name() == "torch::autograd::AccumulateGrad"]
    # the walk: 15 weight casts (2 layers x 7 projections + lm_head) + 11 input casts + SDPA's q, k (2 x 2) + the
    # logits up to fp32 = 31 (tests/test_autocast.py derives each); the fp32 run makes none
    assert (len(fp32_to_copy), len(to_copy), len(weight_casts)) == (0, 31, 15)
    assert f"cast nodes (ToCopyBackward0, autocast's own) 0 → {len(to_copy)}, {len(weight_casts)} of them" in sentence
    assert sentence.startswith(f"autocast none → bfloat16: +{len(to_copy)} nodes;")  # the casts are all the change
    # fp32 master weights: 4 B x P = 4 x 139,584 = 558,336 on both sides
    assert f"parameters {4 * P:,} B both" in sentence
    # the hooks' totals: distinct non-parameter storages of each run
    fp32_total = sum(n for n, _ in fp32_saved.values())
    total = sum(n for n, _ in saved.values())
    assert f"Saved for backward {fp32_total:,} B → {total:,} B" in sentence
    # the bf16 weight copies: every weight a linear reads (all but the 512 x 64 embedding and 5 RMSNorm weights of
    # 64) in 2 B: (139,584 - 32,768 - 320) x 2 = 212,992
    copies = (P - 512 * 64 - 5 * 64) * 2
    assert copies == 212_992 and f"backward 0 B → {copies:,} B" in sentence
    by_dtype = {dtype: sum(n for n, d in saved.values() if d == dtype) for dtype in (torch.float32, torch.bfloat16)}
    fp32_by_dtype = sum(n for n, d in fp32_saved.values() if d == torch.float32)
    assert f"the activations {fp32_total:,} B → {total - copies:,} B" in sentence
    assert f"float32 {fp32_by_dtype:,} B → {by_dtype[torch.float32]:,} B" in sentence
    assert f"bfloat16 0 B → {by_dtype[torch.bfloat16] - copies:,} B" in sentence  # activations saved in 2 B
    # int64: the ids and targets (2 x 32 x 8 B each) = 1,024 on both sides
    assert f"int64 {2 * 2 * 32 * 8:,} B both" in sentence


def _hook_bytes(preset: str, **overrides) -> int:
    """Bytes saved for backward by one forward of `preset`, by saved_tensors_hooks: distinct storages, parameters out."""
    config = config_from_preset(preset, device="cpu", **overrides)
    torch.manual_seed(0)
    model, batch = build_model(config), make_batch(config, "cpu")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compute_loss(config, model(batch.inputs), batch.targets)
    return sum(saved.values())


def _lora_matmul_parts() -> tuple[int, int, int]:
    """llama-tiny's backward matmul FLOPs that LoRA r=8 on q, v changes, by hand."""
    # the frozen weights' gradient matmuls: 2·tokens·in·out for 7 linears x 2 layers + lm_head (64 x 512) = 13,631,488
    weight_grads = 2 * TOKENS * (LAYERS * sum(i * o for i, o in LAYER_LINEARS.values()) + 64 * 512)
    # layer 0's q, k, v read the frozen embedding's output: their input gradients go too, 2·64·(64·64 + 2·64·32)
    layer0 = 2 * TOKENS * sum(LAYER_LINEARS[m][0] * LAYER_LINEARS[m][1] for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                                                   "self_attn.v_proj"))
    # the adapters' GEMMs: grad A, grad B, B's input gradient, A's input gradient (not in layer 0, nothing before)
    adapters = LAYERS * sum(2 * TOKENS * R * (2 * i + 2 * o) for i, o in (LAYER_LINEARS[t] for t in TARGETS))
    adapters -= sum(2 * TOKENS * LAYER_LINEARS[t][0] * R for t in TARGETS)
    assert (weight_grads, layer0, adapters) == (13_631_488, 1_048_576, 786_432)
    return weight_grads, layer0, adapters


def test_full_vs_lora_sentence_splits_the_matmul_flops_and_counts_adapters_only_state():
    full, lora = captured("llama-tiny", device="cpu"), captured("llama-tiny", device="cpu", finetune="lora")
    sentence = _sentence(full, lora)
    walked_full = accumulate_grad_walk(config_from_preset("llama-tiny"))
    walked_lora = accumulate_grad_walk(config_from_preset("llama-tiny", finetune="lora"))
    # AccumulateGrad: 21 tensors (tests/test_autocast.py: TENSORS) vs 2 adapters x 2 targets x 2 layers = 8
    assert (len(walked_full), len(walked_lora)) == (TENSORS, 2 * len(TARGETS) * LAYERS) == (21, 8)
    assert f"in {len(walked_full)} → {len(walked_lora)} AccumulateGrad nodes" in sentence
    # trainable: r(in + out) per target per layer: 2 x (8 x (64+64) + 8 x (64+32)) = 3,584
    adapters_p = LAYERS * sum(R * (LAYER_LINEARS[t][0] + LAYER_LINEARS[t][1]) for t in TARGETS)
    assert f"trainable parameters {P:,} → {adapters_p:,}" in sentence
    assert f"gradients {4 * P:,} B → {4 * adapters_p:,} B" in sentence  # fp32: 4 B per trainable scalar
    # AdamW's state: torch.optim's own after a step for full (8 P + 4 x 21); the adapters': 8 x 3,584 + 4 x 8 tensors
    full_state, _ = _state_after_a_step("adamw")
    assert f"state (torch.optim's own after one step) {full_state:,} B → {8 * adapters_p + 4 * 8:,} B" in sentence
    weight_grads, layer0, adapters = _lora_matmul_parts()
    assert (
        f"−{weight_grads:,} for the gradient matmuls of the {LAYERS * len(LAYER_LINEARS) + 1} matmul weights among "
        f"the {TENSORS} tensors that no longer train" in sentence
    )
    assert f"−{layer0:,} for input gradients nothing needs any more" in sentence
    assert f"+{adapters:,} for the adapters' own matmuls" in sentence
    # and the totals the parts add up to, from each side's own FLOP counter
    a_mm, b_mm = (c.flops.backward_by_category["matmul"] for c in (full, lora))
    assert a_mm - b_mm == weight_grads + layer0 - adapters
    assert f"Backward matmul FLOPs {a_mm:,} FLOPs → {b_mm:,} FLOPs" in sentence
    # saved for backward on each side: saved_tensors_hooks on a plain run of each model (distinct storages, no parameter)
    assert f"saved for backward {_hook_bytes('llama-tiny'):,} B → {_hook_bytes('llama-tiny', finetune='lora'):,} B" in sentence
    # the weights stay (and the adapters join them): 4 B x (139,584 + 3,584)
    assert f"the weights ({4 * P:,} B → {4 * (P + adapters_p):,} B" in sentence


def test_lora_vs_full_reads_the_same_parts_with_the_other_sign():
    back = _sentence(captured("llama-tiny", device="cpu", finetune="lora"), captured("llama-tiny", device="cpu"))
    weight_grads, layer0, adapters = _lora_matmul_parts()
    assert back.startswith("finetune 'lora' → 'full'")
    assert (f"+{weight_grads:,} for the gradient matmuls of the {LAYERS * len(LAYER_LINEARS) + 1} matmul weights "
            f"among the {TENSORS} tensors that start training") in back
    assert f"+{layer0:,} for input gradients now needed" in back
    assert f"−{adapters:,} for the adapters' own matmuls" in back


def _independent_compiled_gpt2_tiny() -> dict:
    """gpt2-tiny compiled here with torch's own APIs (AOTAutograd, inductor's partition_fn and decompositions), the
    FX graphs kept: the compiled step's autograd nodes by a next_functions walk, the backward's recomputed forward ops
    (call_function nodes the forward graph has too, by the joint graph's names) and the eager step's saves by hooks."""
    from tests.test_compile import compiled_keeping_graphs

    config = config_from_preset("gpt2-tiny", device="cpu")
    model, batch = build_model(config), make_batch(config, "cpu")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    eager: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            eager[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compute_loss(config, model(batch.inputs), batch.targets)
    torch._dynamo.reset()
    try:
        compiled, graphs = compiled_keeping_graphs(model)
        loss = compute_loss(config, compiled(batch.inputs), batch.targets)
        nodes = _walk(loss.grad_fn)
        loss.backward()  # compiles the backward
    finally:
        torch._dynamo.reset()
    forward = {n.name for n in graphs["fw"].graph.nodes if n.op == "call_function"}
    recomputed = [n.name for n in graphs["bw"].graph.nodes if n.op == "call_function" and n.name in forward]
    return {"nodes": [n.name() for n in nodes], "recomputed": recomputed, "eager_saved": sum(eager.values())}


def test_eager_vs_compiled_sentence_counts_the_compiled_node_and_the_recomputed_ops():
    from tests.test_compile import independent_gpt2_tiny

    eager, compiled = captured("gpt2-tiny", device="cpu"), captured("gpt2-tiny", device="cpu", compile=True)
    sentence = _sentence(eager, compiled)
    mine, hooks = _independent_compiled_gpt2_tiny(), independent_gpt2_tiny()
    # the compiled step's graph, walked: 1 CompiledFunctionBackward, an AccumulateGrad for each of gpt2-tiny's 28
    # parameter tensors (2 layers x 12 + wte, wpe, ln_f weight and bias) and the loss's 3 nodes = 32
    names = mine["nodes"]
    assert (names.count("CompiledFunctionBackward"), names.count("torch::autograd::AccumulateGrad")) == (1, 28)
    assert len(names) == 1 + 28 + 3
    assert f"the compiled step's {len(names)} nodes are 1 CompiledFunctionBackward" in sentence
    assert f"{names.count('torch::autograd::AccumulateGrad')} AccumulateGrad and 3 outside" in sentence
    # the backward FX graph's nodes (placeholders and output included), as torch's own compile kept it
    assert f"backward FX graphs have {len(hooks['bw_nodes']):,} nodes in all" in sentence
    # saved: eager by hooks; compiled = eager less each LayerNorm's mean, (2, 32, 1) fp32 = 256 B, x 5 norms
    # (tests/test_compile.py derives it); the compiled node's own share is test_compile's hook count on it
    compiled_total = mine["eager_saved"] - hooks["layer_norms"] * 2 * 32 * 1 * 4
    assert f"Saved for backward eager {mine['eager_saved']:,} B → compiled {compiled_total:,} B" in sentence
    assert f"{hooks['hook_bytes']:,} B of it kept by the compiled regions" in sentence
    # recomputed forward ops: GELU's tanh approximation per layer (5 mul, 2 add, 1 tanh) x 2, and views
    assert mine["recomputed"].count("tanh") + sum(n.startswith("tanh_") for n in mine["recomputed"]) == 2
    assert f"recomputes {len(mine['recomputed'])} forward ops instead of keeping their outputs" in sentence


def test_adamw_vs_sgd_sentence_reads_torch_optims_state():
    adamw, sgd = captured("llama-tiny", device="cpu"), captured("llama-tiny", device="cpu", optimizer="sgd")
    sentence = _sentence(adamw, sgd)
    theirs_adamw, _ = _state_after_a_step("adamw")
    theirs_sgd, _ = _state_after_a_step("sgd")
    assert (theirs_adamw, theirs_sgd) == (8 * P + 4 * TENSORS, 0)  # two fp32 moments + a 4 B step per tensor; none
    assert sentence.startswith("optimizer adamw → sgd: no node added or removed")
    assert f"{theirs_adamw:,} B → {theirs_sgd} B" in sentence
    assert f"exp_avg {4 * P:,} B = 4 B × {P:,} parameters + exp_avg_sq {4 * P:,} B" in sentence
    assert f"step {4 * TENSORS} B = 4 B × {TENSORS} tensors; SGD keeps no state" in sentence
    # the same graph, so the same forward + backward peak: the step's peaks differ by AdamW's state alone
    a_peak, b_peak = (int(x.replace(",", "")) for x in re.search(r"peak ([\d,]+) B → ([\d,]+) B", sentence).groups())
    assert a_peak - b_peak == theirs_adamw


PAIRS = {"autocast": ["--autocast", "bfloat16"], "lora": ["--finetune", "lora"], "compile": ["--compile"],
         "sgd": ["--optimizer", "sgd"]}


@pytest.mark.parametrize("pair", PAIRS)
def test_the_cli_compare_json_carries_the_same_sentences(pair, tmp_path):
    out = tmp_path / "diff.json"
    assert main(["compare", "--preset", "gpt2-tiny", "--device", "cpu", "-o", str(out), "--vs", *PAIRS[pair]]) == 0
    diff = json.loads(out.read_text())
    overrides = {"autocast": {"autocast": "bfloat16"}, "lora": {"finetune": "lora"}, "compile": {"compile": True},
                 "sgd": {"optimizer": "sgd"}}[pair]
    page = compare_captures(captured("gpt2-tiny", device="cpu"), captured("gpt2-tiny", device="cpu", **overrides))
    assert diff["explanations"] == list(page.explanations)
    # B is A with that one setting changed; LoRA's own settings (rank, alpha, targets) show on the LoRA side only
    assert [k for k, (a, _) in diff["differing_fields"].items() if a is not None] == list(overrides)
