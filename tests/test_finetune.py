"""Fine-tuning: LoRA adapters from peft and --freeze, checked against counts made apart from the capture engine.

llama-tiny: h=64, 4 heads of 16, 2 key-value heads (k and v are 32 wide), SwiGLU 128, V=512, 2 layers, lm_head
untied; batch 2 x seq 32 = 64 tokens. LoRA r=8 on q_proj and v_proj.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from graphviz_core.analysis.finetuning import compare_finetuning
from graphviz_core.analysis.flop_analysis import rule_of_thumb
from graphviz_core.analysis.training_step import training_step_of
from graphviz_core.capture.engine import capture_backward
from graphviz_core.cli import main
from graphviz_core.config import config_from_preset
from graphviz_core.models.registry import build_model, compute_loss, make_batch
from tests.conftest import captured

H, KV, INTER, V, LAYERS, R = 64, 32, 128, 512, 2, 8
TOKENS = 2 * 32
# (in, out) of every linear layer of one llama-tiny layer, and the head
LAYER_LINEARS = {"self_attn.q_proj": (H, H), "self_attn.k_proj": (H, KV), "self_attn.v_proj": (H, KV),
                 "self_attn.o_proj": (H, H), "mlp.gate_proj": (H, INTER), "mlp.up_proj": (H, INTER),
                 "mlp.down_proj": (INTER, H)}
TARGETS = ("self_attn.q_proj", "self_attn.v_proj")


def accumulate_grad_walk(config) -> list[str]:
    """The parameters reached by a plain forward's autograd graph, by a next_functions walk of our own (not the
    engine's): names of the AccumulateGrad nodes' variables."""
    model = build_model(config)
    batch = make_batch(config, "cpu")
    loss = compute_loss(config, model(batch.inputs), batch.targets)
    names = {p: n for n, p in model.named_parameters()}
    seen, stack, found = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad":
            found.append(names[node.variable])
        stack.extend(child for child, _ in node.next_functions)
    return sorted(found)


def lora_capture():
    return captured("llama-tiny", finetune="lora", device="cpu")


def full_capture():
    return captured("llama-tiny", device="cpu")


def test_lora_accumulate_grad_nodes_are_two_per_target_per_layer():
    config = config_from_preset("llama-tiny", finetune="lora")
    walked = accumulate_grad_walk(config)
    # lora_A and lora_B for each of 2 targets in each of 2 layers: 2 x 2 x 2 = 8
    assert len(walked) == 2 * len(TARGETS) * LAYERS == 8
    assert all(".lora_A." in n or ".lora_B." in n for n in walked)
    capture = lora_capture()
    graph_params = sorted(d["param"]["name"] for _, d in capture.graph.nodes(data=True) if d["op"] == "AccumulateGrad")
    assert graph_params == walked
    assert capture.summary.parameters == 8


def test_lora_trainable_parameters_by_formula():
    # r·(in + out) per target: q 8·(64+64) = 1,024, v 8·(64+32) = 768; x 2 layers = 3,584
    per_layer = sum(R * (LAYER_LINEARS[t][0] + LAYER_LINEARS[t][1]) for t in TARGETS)
    assert per_layer * LAYERS == 3_584
    capture = lora_capture()
    assert capture.summary.parameter_count == per_layer * LAYERS
    # the frozen base model is every parameter full fine-tuning trains (counted by the other capture)
    assert capture.summary.frozen_parameter_count == full_capture().summary.parameter_count
    assert capture.summary.frozen_parameters == full_capture().summary.parameters == 21
    # gradients: 4 B (float32) per trainable parameter only; weights: every parameter, the adapters too
    assert capture.memory.gradient_bytes == 4 * 3_584
    assert capture.memory.parameter_bytes == 4 * (3_584 + full_capture().summary.parameter_count)


def _flops_of_module(capture, module: str) -> int:
    return sum(d["flops"] for _, d in capture.graph.nodes(data=True) if d["module"] == module)


def test_frozen_linear_saves_exactly_its_weight_gradient_matmul():
    """Where a frozen linear's input still needs a gradient (layer 1, the head), full minus LoRA at that layer is its
    weight-gradient GEMM, 2·tokens·in·out, exactly."""
    full, lora = full_capture(), lora_capture()
    layer1 = {f"model.layers.1.{m}": shape for m, shape in LAYER_LINEARS.items() if m not in TARGETS}
    for module, (fan_in, fan_out) in {**layer1, "lm_head": (H, V)}.items():
        assert _flops_of_module(full, module) - _flops_of_module(lora, module) == 2 * TOKENS * fan_in * fan_out, module


def test_backward_matmul_flops_full_minus_lora():
    full, lora = full_capture(), lora_capture()
    # every frozen weight's gradient GEMM: 2·tokens·in·out for 7 linears x 2 layers + lm_head
    # = 2·64·(2 x 36,864 + 32,768) = 13,631,488
    weight_grads = 2 * TOKENS * (LAYERS * sum(i * o for i, o in LAYER_LINEARS.values()) + H * V)
    assert weight_grads == 13_631_488
    # layer 0's q, k and v read the embedding, which is frozen: no input gradient there either, 2·64·(4,096 + 2 x 2,048)
    layer0_inputs = 2 * TOKENS * sum(LAYER_LINEARS[m][0] * LAYER_LINEARS[m][1] for m in ("self_attn.q_proj",
                                                                                         "self_attn.k_proj",
                                                                                         "self_attn.v_proj"))
    assert layer0_inputs == 1_048_576
    # the adapters' own backward GEMMs: grad A (2·T·in·r), grad B (2·T·r·out), B's input (2·T·r·out) and A's input
    # (2·T·in·r, not in layer 0); q: 4 x 65,536, v: 2 x 65,536 + 2 x 32,768; layer 0 without A's input
    adapters = sum(2 * TOKENS * R * (2 * i + 2 * o) for i, o in (LAYER_LINEARS[t] for t in TARGETS)) * LAYERS
    adapters -= sum(2 * TOKENS * LAYER_LINEARS[t][0] * R for t in TARGETS)
    assert adapters == 786_432
    matmul = full.flops.backward_by_category["matmul"] - lora.flops.backward_by_category["matmul"]
    assert matmul == weight_grads + layer0_inputs - adapters == 13_893_632


def test_lora_optimizer_state_is_the_adapters_only():
    full, lora = training_step_of(full_capture(), "adamw"), training_step_of(lora_capture(), "adamw")
    # AdamW after one step (torch.optim's own state): two fp32 moments per trainable parameter + a 4 B step per tensor
    assert lora.optimizer_state_bytes == 8 * 3_584 + 4 * 8 == 28_704
    assert full.optimizer_state_bytes == 8 * 139_584 + 4 * 21 == 1_116_756
    assert lora.parameter_bytes == full.parameter_bytes + 4 * 3_584  # weights stay, adapters added


def test_freeze_embedding_removes_its_accumulate_grad():
    config = config_from_preset("llama-tiny", freeze="*embed*")
    walked = accumulate_grad_walk(config)
    # 21 parameter tensors, the token embedding frozen: 20 reached
    assert len(walked) == 20 and "model.embed_tokens.weight" not in walked
    capture = captured("llama-tiny", freeze="*embed*", device="cpu")
    ops = capture.summary.by_op
    assert ops["AccumulateGrad"] == 20 and "EmbeddingBackward0" not in ops
    assert capture.summary.frozen_parameter_count == V * H  # 512 x 64 = 32,768


def test_lora_on_meta_counts_what_cpu_runs():
    meta = capture_backward(config_from_preset("llama-tiny", finetune="lora", device="meta"))
    cpu = lora_capture()
    assert (meta.summary.parameters, meta.summary.parameter_count) == (cpu.summary.parameters, cpu.summary.parameter_count)
    assert meta.flops.backward == cpu.flops.backward
    assert meta.memory.saved_bytes == cpu.memory.saved_bytes


@pytest.mark.parametrize(("preset", "lora_b_out"), [
    ("gpt2-hf-tiny", 3 * H),  # c_attn is q, k and v in one Conv1D: B spans 3h = 192 outputs
    ("bert-tiny", H),  # query, value
    ("gpt2-tiny", 3 * H),  # the teaching model's fused qkv
])
def test_family_default_targets(preset, lora_b_out):
    capture = captured(preset, finetune="lora", device="cpu")
    shapes = [d["param"]["shape"] for _, d in capture.graph.nodes(data=True)
              if d["op"] == "AccumulateGrad" and ".lora_B." in d["param"]["name"]]
    assert shapes and all(shape == [lora_b_out, R] for shape in shapes)
    assert not [d["op"] for _, d in capture.graph.nodes(data=True) if d["category"] == "other"]


def test_rule_of_thumb_still_sums_exactly_under_lora():
    rule = rule_of_thumb(lora_capture())
    assert rule.parameters == 3_584 + 139_584  # every weight runs in the forward
    assert rule.rule_flop + sum(t.flop for t in rule.gap) == rule.measured_flop


@pytest.mark.parametrize(("overrides", "words"), [
    (dict(finetune="lora", lora_targets="nope"), "q_proj"),  # lists real module names
    (dict(finetune="lora", lora_targets="input_layernorm"), "linear"),
    (dict(freeze="*nothing*"), "model.embed_tokens.weight"),
])
def test_targets_and_globs_that_match_nothing_say_so(overrides, words):
    with pytest.raises(ValueError, match=words):
        capture_backward(config_from_preset("llama-tiny", device="cpu", **overrides))


def test_resnet_needs_named_targets():
    with pytest.raises(ValueError, match="lora_targets"):
        config_from_preset("resnet-tiny", finetune="lora")


def test_cli_refuses_a_bad_target_with_exit_2(capsys):
    assert main(["graph", "--preset", "llama-tiny", "--device", "cpu", "--finetune", "lora", "--lora-targets", "nope",
                 "--format", "json", "-o", "/dev/null"]) == 2
    assert "matches no module" in capsys.readouterr().err


def test_compare_finetuning_side_by_side():
    both = compare_finetuning(config_from_preset("llama-tiny", finetune="lora"))
    rows = {what: (full, tuned) for what, full, tuned, _ in both.savings()}
    assert rows["gradients (bytes)"] == (4 * 139_584, 4 * 3_584)
    assert rows["AccumulateGrad nodes"] == (21, 8)
    assert rows["saved for backward (bytes)"][1] > 0  # activations stay
    assert both.tuned.label == "LoRA r=8, alpha 16 on q_proj, v_proj"
    why = {what: reason for what, _, _, reason in both.savings()}
    # float32 weights: no master copy on either side, and the sentence says none is kept (it read "keeps fp32 copies")
    assert rows["fp32 master weights (bytes)"] == (0, 0)
    assert why["fp32 master weights (bytes)"].startswith("none kept: float32 weights are their own master copy")
    assert why["weights (bytes)"].startswith("not spared")  # "saved" is the saved-for-backward row's word



def test_a_freeze_only_comparison_speaks_of_frozen_parameters_not_adapters():
    """--freeze without LoRA: the tuned side adds no adapter, so neither the title nor any sentence may speak of
    adapters (it was titled "Full fine-tuning vs LoRA" and said "plus the adapters" four times)."""
    from graphviz_core.analysis.finetuning import comparison_title, tuned_twin

    config = config_from_preset("llama-tiny", freeze="*embed*")
    both = compare_finetuning(config)
    assert not both.adapters and comparison_title(tuned_twin(config)) == "Full fine-tuning vs frozen parameters"
    assert not [why for *_, why in both.savings() if "adapter" in why]
    rows = {what: (full, tuned) for what, full, tuned, _ in both.savings()}
    # the embedding alone is frozen: vocab 512 x hidden 64 = 32,768 scalars fewer get a gradient
    assert rows["trainable parameters"][0] - rows["trainable parameters"][1] == 512 * 64
    lora = compare_finetuning(config_from_preset("llama-tiny", finetune="lora"))
    assert lora.adapters and comparison_title(lora.config) == "Full fine-tuning vs LoRA"
    assert sum("adapter" in why for *_, why in lora.savings()) == 4

def test_full_fine_tuning_imports_no_peft():
    code = ("import sys\nfrom graphviz_core.capture.engine import capture_backward\n"
            "from graphviz_core.config import config_from_preset\n"
            "capture_backward(config_from_preset('gpt2-tiny', device='cpu'))\nprint('peft' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_lora_gradients_flow_to_b_first():
    """peft starts B at zero (the adapter adds nothing at step 0), so A's first gradient is zero and B's is not."""
    capture = lora_capture()
    norms = {d["param"]["name"]: d["grad_norm"] for _, d in capture.graph.nodes(data=True) if d["op"] == "AccumulateGrad"}
    assert all(v == 0 for k, v in norms.items() if ".lora_A." in k)
    assert all(v > 0 for k, v in norms.items() if ".lora_B." in k)


def test_form_lora_fields_show_when_lora_is_chosen_and_run():
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120).run()
    at.selectbox(key="config.preset").set_value("llama-tiny").run()
    keys = {w.key for w in at.sidebar.number_input}
    assert "config.lora_rank" not in keys  # full fine-tuning: no LoRA fields
    at.selectbox(key="config.finetune").set_value("lora").run()
    assert {"config.lora_rank", "config.lora_alpha"} <= {w.key for w in at.sidebar.number_input}
    at.number_input(key="config.lora_rank").set_value(4)
    at.text_input(key="config.freeze").set_value("*embed*")
    next(b for b in at.button if b.label == "Run backward pass").click().run()
    assert not at.exception and not at.error
    # r=4 on q (4·(64+64) = 512) and v (4·(64+32) = 384), 2 layers: 1,792 trainable parameters in 8 tensors
    assert "1,792" in [m.value for m in at.metric]
    assert any("LoRA r=4, alpha 16 on q_proj, v_proj; frozen: *embed*" in c.value.replace("\\", "") for c in at.caption)


def test_a_link_carries_lora_and_freeze():
    from graphviz_core.ui.links import config_params, parse_config

    config = config_from_preset("llama-tiny", finetune="lora", lora_rank=4, lora_alpha=8,
                                lora_targets="q_proj,o_proj", freeze="*embed*")
    params = config_params(config)
    assert params["finetune"] == "lora" and params["freeze"] == "*embed*" and params["lora_targets"] == "q_proj,o_proj"
    back, problems = parse_config(params)
    assert problems == [] and back == config.replace(preset="")


def test_will_it_fit_counts_frozen_weights_as_weights_only():
    from graphviz_core.analysis.fit import largest_fitting

    config = config_from_preset("llama-tiny", finetune="lora", device="meta")
    # AdamW, float32, the closed-form floor: 4 B per weight (3,584 + 139,584 = 143,168) + 4 B gradient and 8 B of
    # state per trainable parameter (3,584) = 572,672 + 14,336 + 28,672 = 615,680 B; full fine-tuning's would be
    # 16 B x 139,584 = 2,233,344 B
    floor = 4 * (3_584 + 139_584) + 4 * 3_584 + 8 * 3_584
    assert floor == 615_680
    under = largest_fitting(config, floor - 1, "none", "batch", "adamw", 3_584, 139_584)
    assert under.weights_alone_exceed and under.largest == 0
    over = largest_fitting(config, floor, "none", "batch", "adamw", 3_584, 139_584)
    assert not over.weights_alone_exceed


def test_parallel_simulation_refuses_a_bad_layout_with_lora_with_a_sentence(capsys):
    # LoRA is simulated under every strategy (tests/test_parallel_lora.py); a layout the model cannot take is still
    # one sentence: llama-tiny's 4 heads do not split over TP 3.
    assert main(["graph", "--preset", "llama-tiny", "--finetune", "lora", "--strategy", "tp", "--world-size", "3",
                 "--tp", "3", "--format", "json", "-o", "/dev/null"]) == 2
    assert "4 attention heads are not divisible by TP degree 3" in capsys.readouterr().err


def test_compare_says_what_lora_changes():
    from graphviz_core.analysis.compare import compare_captures
    from graphviz_core.analysis.compare_reasons import explain

    sentences = explain(compare_captures(full_capture(), lora_capture()))
    assert len(sentences) == 1
    # 21 → 8 AccumulateGrad nodes (counted by test_lora_accumulate_grad_nodes_are_two_per_target_per_layer)
    assert "finetune 'full' → 'lora'" in sentences[0] and "21 → 8 AccumulateGrad nodes" in sentences[0]


def test_lora_over_a_bfloat16_base_keeps_float32_adapters():
    capture = capture_backward(config_from_preset("llama-tiny", finetune="lora", dtype="bfloat16", device="meta"))
    step = training_step_of(capture, "adamw")
    # peft upcasts the adapters to float32: weights 2 B x 139,584 base + 4 B x 3,584 adapters = 293,504 B;
    # gradients 4 B x 3,584 = 14,336 B; no fp32 master copy (the adapters are float32 already)
    assert step.parameter_bytes == 2 * 139_584 + 4 * 3_584 == 293_504
    assert step.gradient_bytes == 4 * 3_584 and step.master_weight_bytes == 0
    assert step.sum_of_parts_bytes == (293_504 + 14_336 + step.optimizer_state_bytes + step.activation_peak_bytes)
