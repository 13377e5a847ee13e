"""Mixed precision as training runs it (--autocast): the cast nodes, the fp32 master weights, the 16-bit copies saved
for backward, the meta dry run on fake tensors, and the training step's terms. Every count is checked against an
independent one: a next_functions walk of the same model run under torch.autocast, a saved_tensors_hooks count."""

from __future__ import annotations

import pytest
import torch

from graphviz_core.analysis.memory_breakdown import saved_bytes_by_layer
from graphviz_core.analysis.step_terms import step_parts
from graphviz_core.analysis.training_step import MEASURED, training_step_of
from graphviz_core.config import config_from_preset
from graphviz_core.models.registry import build_model, compute_loss, make_batch
from graphviz_core.units import format_bytes
from tests.conftest import captured

# llama-tiny: hidden 64, 4 heads (head 16), 2 key-value heads, MLP 128, 2 layers, vocabulary 512, batch 2, seq 32.
P = 139_584  # 512*64 embedding + 2 * (q 64*64 + k 64*32 + v 64*32 + o 64*64 + gate, up, down 3*64*128 + 2 norms 2*64)
#             + final norm 64 + lm_head 512*64 = 32,768 + 2*53,376 + 64 + 32,768
TENSORS = 21  # 2 layers x 9 tensors + embedding + final norm + lm_head


def _walk(root) -> list:
    """Every node reachable from `root` through next_functions (the test's own walk, not the capture's)."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return list(seen)


def _independent_run(autocast: bool):
    """llama-tiny's forward and loss as a training script writes them, with every saved tensor recorded."""
    config = config_from_preset("llama-tiny", device="cpu")
    torch.manual_seed(0)
    model = build_model(config)
    batch = make_batch(config, "cpu")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[int, torch.dtype]] = {}  # storage address -> (bytes, dtype), parameters left out

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
        return t

    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
        loss = compute_loss(config, model(batch.inputs), batch.targets)
    return model, loss, saved


def test_autocast_bf16_casts_are_the_walks_to_copy_nodes_and_the_weights_stay_fp32():
    capture = captured("llama-tiny", device="cpu", autocast="bfloat16")
    model, loss, saved = _independent_run(autocast=True)
    nodes = _walk(loss.grad_fn)
    to_copy = [n for n in nodes if n.name() == "ToCopyBackward0"]
    _, fp32_loss, _ = _independent_run(autocast=False)
    # Without autocast the same model makes no ToCopyBackward0 at all (its own .to(float32) calls are no-ops on fp32
    # tensors), so every one under autocast is autocast's. By hand: 15 weight casts (2 layers x 7 projections +
    # lm_head), 11 input casts (per layer q, k, v and gate, up read the fp32 normed input: 5 x 2, + lm_head's), SDPA's
    # q and k (fp32 after the rotary embedding) 2 x 2, cross-entropy's logits up to fp32: 15 + 11 + 4 + 1 = 31.
    assert not [n for n in _walk(fp32_loss.grad_fn) if n.name() == "ToCopyBackward0"]
    assert capture.summary.by_category["cast"] == len(to_copy) == 31
    weight_casts = [n for n in to_copy if n.next_functions[0][0].name() == "torch::autograd::AccumulateGrad"]
    assert capture.autocast.weight_casts == len(weight_casts) == 15
    assert capture.summary.by_category.get("conversion", 0) == 0  # none of them is the model's own
    # The parameters stay fp32: autograd accumulates fp32 gradients into fp32 weights.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert capture.summary.parameter_count == sum(p.numel() for p in model.parameters()) == P
    assert capture.memory.parameter_bytes == capture.memory.gradient_bytes == 4 * P
    # Saved bytes: the independent saved_tensors_hooks count of distinct non-parameter storages.
    assert capture.memory.saved_bytes == sum(nbytes for nbytes, _ in saved.values())
    # The 16-bit weight copies autocast saved: every weight a linear reads, i.e. all but the embedding table and the
    # 5 RMSNorm weights (64 each), in 2 bytes: (139,584 - 32,768 - 320) x 2 = 212,992.
    assert capture.autocast.weight_copy_bytes == (P - 512 * 64 - 5 * 64) * 2 == 212_992
    bf16_saves = sum(e.storage_bytes for e in capture.save_order if e.counted and e.dtype == "bfloat16")
    assert bf16_saves >= capture.autocast.weight_copy_bytes  # the copies are among the bf16 saves
    assert any(data["category"] == "cast" and data["module"] for _, data in capture.graph.nodes(data=True))


def test_the_meta_dry_run_under_autocast_saves_what_cpu_saves_layer_by_layer():
    cpu = captured("llama-tiny", device="cpu", autocast="bfloat16")
    meta = captured("llama-tiny", device="meta", autocast="bfloat16")
    assert meta.device == "meta" and meta.loss is None  # fake tensors: no values
    assert saved_bytes_by_layer(meta) == saved_bytes_by_layer(cpu)
    assert meta.memory.saved_bytes == cpu.memory.saved_bytes
    assert meta.summary.by_category == cpu.summary.by_category
    assert meta.autocast.weight_copy_bytes == cpu.autocast.weight_copy_bytes
    # Plain meta tensors have no autocast dispatch key: without fake tensors nothing would be cast at all.
    plain = torch.nn.Linear(4, 4, device="meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain(torch.empty(2, 4, device="meta")).dtype == torch.float32


def test_the_training_step_under_autocast_counts_fp32_weights_grads_adamw_and_the_activations():
    capture = captured("llama-tiny", device="cpu", autocast="bfloat16")
    step = training_step_of(capture)
    assert step.optimizer == "adamw" and step.optimizer_state_source == MEASURED
    assert step.parameter_bytes == 4 * P  # fp32 weights
    assert step.gradient_bytes == 4 * P  # fp32 gradients
    assert step.master_weight_bytes == 0  # the weights are the master weights
    assert step.optimizer_state_bytes == 8 * P + 4 * TENSORS  # exp_avg + exp_avg_sq fp32, a 4 B step per tensor
    assert step.sum_of_parts_bytes == 4 * P + 4 * P + 8 * P + 4 * TENSORS + step.activation_peak_bytes
    parts = step_parts(capture, step)
    terms = {term: b for term, b, _ in parts}
    assert terms["weights"] == terms["gradients"] == 4 * P
    assert terms["optimizer state"] == 8 * P + 4 * TENSORS
    assert terms["bfloat16 weight copies"] == 212_992
    assert terms["activations at their peak"] + terms["bfloat16 weight copies"] == step.activation_peak_bytes
    assert terms["sum of the parts"] == sum(b for t, b in terms.items() if t not in ("sum of the parts", "step peak"))
    # the activations' term says what was saved in 16 bits besides the weight copies: the independent hooks' bfloat16
    # bytes less the 212,992 B of copies
    _, _, saved = _independent_run(autocast=True)
    bf16 = sum(nbytes for nbytes, dtype in saved.values() if dtype == torch.bfloat16) - 212_992
    what = next(w for t, _, w in parts if t == "activations at their peak")
    assert f"{format_bytes(bf16)} bfloat16" in what, what


def test_float16_autocast_scales_the_loss_and_steps_through_the_scaler():
    capture = captured("llama-tiny", device="cpu", autocast="float16")
    # backward starts from the scaled loss: loss x scale is one more node than the bf16 graph, a Mul at the root
    bf16 = captured("llama-tiny", device="cpu", autocast="bfloat16")
    assert capture.summary.nodes == bf16.summary.nodes + 1
    assert capture.summary.by_category["cast"] == 31
    assert "GradScaler" in capture.autocast.scaler and "65,536" in capture.autocast.scaler
    assert any("found them finite and ran" in note for note in capture.notes)
    # the loss's scaling is said once (the scaler's note), not again by the optimizer's step
    assert sum("loss was" in note and "scale" in note for note in capture.notes) == 1
    assert capture.optimizer.stepped and capture.optimizer.state_bytes == 8 * P + 4 * TENSORS
    # The gradient norms read as the optimizer's (unscaled): each parameter's within 5% of the fp32 run's, where a
    # scale left in would read 65,536 times larger
    fp32 = captured("llama-tiny", device="cpu")
    norms32 = {d["param"]["name"]: d["grad_norm"] for _, d in fp32.graph.nodes(data=True) if d["param"]}
    norms16 = {d["param"]["name"]: d["grad_norm"] for _, d in capture.graph.nodes(data=True) if d["param"]}
    assert norms16.keys() == norms32.keys()
    for name, norm in norms32.items():
        assert norms16[name] == pytest.approx(norm, rel=0.05, abs=1e-6), name


@pytest.mark.parametrize("preset", ["bert-tiny", "resnet-tiny", "mixtral-tiny"])
def test_other_families_dry_runs_under_autocast_save_what_cpu_saves(preset):
    # The dry run's fake tensors take torch's meta kernels, which give a LayerNorm's or BatchNorm's saved statistics
    # the input's 16-bit dtype where the CPU kernels keep them in float32, and refuse the mixture of experts' float32
    # grouped matmul the CPU runs: the capture answers both as the CPU does (capture.meta_kernels).
    cpu = captured(preset, device="cpu", autocast="bfloat16")
    meta = captured(preset, device="meta", autocast="bfloat16")
    assert meta.memory.saved_bytes == cpu.memory.saved_bytes
    assert meta.summary.by_category == cpu.summary.by_category and cpu.summary.by_category["cast"] > 0
    assert meta.optimizer.bytes_by_key == cpu.optimizer.bytes_by_key


def test_a_module_brought_on_meta_under_autocast_is_refused_with_a_sentence():
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.models.family import Source

    # built on meta before the capture: autocast would cast nothing there (no CPU/CUDA dispatch key), so no dry run
    model = torch.nn.Linear(8, 2, device="meta")
    source = Source(model, (torch.empty(4, 8, device="meta"),), lambda out: out.sum())
    config = config_from_preset("llama-tiny", device="meta", autocast="bfloat16")
    with pytest.raises(ValueError, match="a dry run under autocast needs a model the app builds"):
        capture_backward(config, source=source)
