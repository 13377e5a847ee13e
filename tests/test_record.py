"""graphviz_core.record on real training loops: an MLP with SGD, a transformers GPT-2 (random weights, config typed
here) with AdamW and 4-step gradient accumulation, and float16 autocast with a GradScaler, each figure checked
against the same quantity taken by hand in the same loop; torch.autograd.grad and a non-scalar loss; the recording
read back through graph/recording.py."""

import math

import pytest
import torch

import graphviz_core
from graphviz_core.graph.recording import open_recording


def close(a, b, rel=1e-5):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def norms(model):
    return {n: float(torch.linalg.vector_norm(p.grad)) for n, p in model.named_parameters() if p.grad is not None}


def test_mlp_with_sgd_gradient_norms_and_update_ratio(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    by_hand, weights, losses, ends = [], [], [], []
    with graphviz_core.record(tmp_path / "mlp", steps=3, model=model):
        for _ in range(5):  # the loop runs on after the 3 recorded steps
            loss = torch.nn.functional.cross_entropy(model(torch.randn(6, 8)), torch.randint(0, 3, (6,)))
            loss.backward()
            by_hand.append(norms(model))
            ends.append({n: (float(p.grad.min()), float(p.grad.max()), float(p.grad.abs().max()))
                         for n, p in model.named_parameters()})
            weights.append({n: float(torch.linalg.vector_norm(p.detach())) for n, p in model.named_parameters()})
            losses.append(float(loss.detach()))
            opt.step()
            opt.zero_grad()
    recording = open_recording(tmp_path / "mlp")
    assert recording.complete and recording.ranks == [0]
    steps = recording.steps()
    assert [s.step for s in steps] == [0, 1, 2]
    for step, grads, ws, loss in zip(steps, by_hand, weights, losses, strict=False):
        assert close(step.loss, loss) and step.lr == lr and not step.skipped
        assert set(step.parameters) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        for name, p in step.parameters.items():
            assert close(p.grad_norm, grads[name]) and close(p.weight_norm, ws[name])
            # plain SGD: the update is lr * g, so |update| / |w| = lr * |g| / |w|
            assert close(p.update_ratio, lr * grads[name] / ws[name])
        # the whole gradient's norm: the root of the parameters' squared norms
        assert close(step.grad_norm, math.sqrt(sum(v * v for v in grads.values())))
    # one distinct graph, stored once, read back in graph/schema.py's records, each node with its step's figures
    assert len(recording.to_dict()["graphs"]) == 1
    graph = recording.step_graph(1)
    leaves = {d["param"]["name"]: d for _, d in graph.nodes(data=True) if d["op"] == "AccumulateGrad"}
    for name, data in leaves.items():
        assert close(data["grad_norm"], by_hand[1][name], rel=1e-6)  # stored as float32
        assert data["nonfinite"] == 0 and data["time_s"] >= 0
        # the gradient's smallest and largest value, signed, and its largest magnitude: torch's own reads of p.grad
        low, high, top = ends[1][name]
        assert (data["min"], data["max"], data["max_abs"]) == (low, high, top) and low < 0 < high
    matmuls = [d for _, d in graph.nodes(data=True) if d["op"] == "AddmmBackward0"]
    # Linear(16, 3) on 6 rows: grad wrt input 2*6*3*16 = 576 and wrt weight 2*3*6*16 = 576 FLOPs; Linear(8, 16) only
    # the weight's (its input needs no gradient): 2*16*6*8 = 1,536
    assert sorted(d["flops"] for d in matmuls) == [1152, 1536]
    assert {d["module"] for d in matmuls} == {"0", "2"} and {d["category"] for d in matmuls} == {"matmul"}
    # each Linear saved its float32 input for its weight's gradient: 6x8x4 = 192 and 6x16x4 = 384 bytes; the weights,
    # parameters, are not counted
    assert sorted(d["saved_bytes"] for d in matmuls) == [192, 384]


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=24, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(1)
    return GPT2LMHeadModel(config)


def test_gpt2_adamw_with_four_step_accumulation(tmp_path):
    model = _tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    accumulation, by_hand, micro = 4, [], []
    with graphviz_core.record(tmp_path / "gpt2", steps=2) as rec:  # no model= : names from the forward's module
        for _step in range(2):
            contributions = []
            for _ in range(accumulation):
                ids = torch.randint(0, 97, (2, 12))
                before = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                          for n, p in model.named_parameters()}
                (model(ids, labels=ids).loss / accumulation).backward()
                contributions.append(math.sqrt(sum(float(torch.linalg.vector_norm(p.grad - before[n])) ** 2
                                                   for n, p in model.named_parameters())))
            by_hand.append(norms(model))
            micro.append(contributions)
            opt.step()
            opt.zero_grad()
        assert rec.steps_written == 2
    steps = open_recording(tmp_path / "gpt2").steps()
    assert len(steps) == 2
    for step, grads, contributions in zip(steps, by_hand, micro, strict=True):
        assert len(step.backward_graphs) == accumulation and len(set(step.backward_graphs)) == 1
        # gpt2's lm_head is tied to wte: one tensor, named once, by its first name
        assert set(step.parameters) == {n for n in grads}
        assert "transformer.h.1.attn.c_attn.weight" in step.parameters
        for name, p in step.parameters.items():
            assert close(p.grad_norm, grads[name]), name
            assert p.update_norm > 0
            # GPT-2 starts its biases at zero: a ratio to a zero weight is null, not a division by zero
            assert p.update_ratio is None if p.weight_norm == 0 else close(p.update_ratio, p.update_norm / p.weight_norm)
        # each backward's gradient into the parameters is that micro-batch's contribution to .grad
        for recorded, taken in zip(step.micro_grad_norms, contributions, strict=True):
            assert close(recorded, taken, rel=1e-4)
        assert close(step.loss, sum(step.micro_losses))  # the sum of the backward roots (each loss / 4)


def test_float16_autocast_with_a_grad_scaler_unscaled_and_skipped(tmp_path):
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    by_hand, scales, ends = [], [], []
    with graphviz_core.record(tmp_path / "amp", model=model):
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(5, 8))
            loss = out.float().pow(2).mean()
            if step == 2:
                loss = loss * float("inf")  # an overflow: the scaler finds inf and skips this step
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            by_hand.append(norms(model))
            ends.append({n: (float(p.grad.min()), float(p.grad.max())) for n, p in model.named_parameters()})
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    steps = open_recording(tmp_path / "amp").steps()
    assert [s.skipped for s in steps] == [False, False, True, False]
    assert [s.scale for s in steps] == scales
    assert steps[2].loss is None  # not finite
    for step, grads in zip(steps, by_hand, strict=True):
        for name, p in step.parameters.items():
            if step.skipped:
                assert not math.isfinite(p.grad_norm) and p.update_norm == 0.0
            else:
                assert close(p.grad_norm, grads[name]), name  # unscaled, as the optimizer stepped with it
    recording = open_recording(tmp_path / "amp")
    clean, broken = recording.step_graph(1), recording.step_graph(2)
    assert all(d["nonfinite"] == 0 for _, d in clean.nodes(data=True))
    assert sum(d["nonfinite"] for _, d in broken.nodes(data=True)) > 0
    leaf = next(d for _, d in clean.nodes(data=True) if d["op"] == "AccumulateGrad" and d["param"]["name"] == "2.bias")
    assert close(leaf["grad_norm"], by_hand[1]["2.bias"], rel=1e-5)  # node figures are unscaled too
    weight = next(d for _, d in clean.nodes(data=True) if d["op"] == "AccumulateGrad" and d["param"]["name"] == "0.weight")
    low, high = ends[1]["0.weight"]  # the scaled gradient's ends divided by the scale: the unscaled gradient's
    assert close(weight["min"], low, rel=1e-5) and close(weight["max"], high, rel=1e-5) and low < 0 < high
    # a gradient holding an inf or a NaN: its ends say so (±inf, or NaN for a NaN), never a finite pair
    assert all(not (math.isfinite(d["min"]) and math.isfinite(d["max"])) for _, d in broken.nodes(data=True)
               if d["nonfinite"])


def test_autograd_grad_and_a_non_scalar_loss(tmp_path):
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graphviz_core.record(tmp_path / "other", model=model) as rec:
        out = model(torch.randn(3, 4))
        out.backward(torch.ones_like(out))  # not a scalar: its gradient given
        opt.step()
        opt.zero_grad()
        x = torch.randn(3, 4, requires_grad=True)
        total = model(x).sum()
        value = float(total.detach())
        (gx,) = torch.autograd.grad(total, x)  # a gradient taken, .grad left alone
        rec.step()  # no optimizer step: closed by hand
    steps = open_recording(tmp_path / "other").steps()
    assert len(steps) == 2
    assert steps[0].loss is None and len(steps[0].backward_graphs) == 1
    assert steps[0].parameters["weight"].update_norm is not None
    assert close(steps[1].loss, value)  # torch.autograd.grad's root is the step's loss too
    assert len(steps[1].backward_graphs) == 1 and steps[1].parameters == {}  # no .grad: no parameter row
    assert steps[1].micro_grad_norms and math.isnan(steps[1].micro_grad_norms[0])  # no AccumulateGrad ran


def test_bad_arguments_are_refused_with_a_sentence(tmp_path):
    for kwargs, said in (({"steps": 0}, "steps must be"), ({"model": "gpt2"}, "model must be"),
                         ({"check_forward": True, "nodes": False}, "check_forward needs")):
        with pytest.raises(ValueError, match=said):
            with graphviz_core.record(tmp_path / "x", **kwargs):
                pass
    with graphviz_core.record(tmp_path / "y"):
        with pytest.raises(ValueError, match="already running"):
            with graphviz_core.record(tmp_path / "z"):
                pass
    with pytest.raises(ValueError, match="already holds a recording"):
        with graphviz_core.record(tmp_path / "y"):
            pass


def test_parameters_only_records_no_node_figures(tmp_path):
    """nodes=False changes what is computed: no per-node hooks, no graph, the same parameter figures."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    by_hand = []
    with graphviz_core.record(tmp_path / "lean", nodes=False):  # no model=: names from the forward all the same
        for _ in range(2):
            model(torch.randn(3, 4)).pow(2).mean().backward()
            by_hand.append(norms(model))
            opt.step()
            opt.zero_grad()
    recording = open_recording(tmp_path / "lean")
    steps = recording.steps()
    assert [s.backward_graphs for s in steps] == [[], []] and recording.to_dict()["graphs"] == []
    assert all(s.loss is not None and len(s.micro_losses) == 1 for s in steps)
    for step, grads in zip(steps, by_hand, strict=True):
        assert set(step.parameters) == set(grads)
        assert all(close(step.parameters[n].grad_norm, grads[n]) for n in grads)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_model_trains_the_same_under_the_recorder(tmp_path, reentrant):
    """Under checkpointing the recorded step computes the same gradients as the bare one (saved bytes are read from
    raw saved fields: a checkpoint's packed tensors are never unpacked, which would run its forward again), and a
    reentrant checkpoint's inner backward is part of the outer one, not a backward of the step of its own."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(5)
    inner = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU(), torch.nn.Linear(6, 6))
    head = torch.nn.Linear(6, 1)

    def loss_of(x):
        return head(checkpoint(inner, x, use_reentrant=reentrant)).pow(2).mean()

    x = torch.randn(5, 6, requires_grad=reentrant)
    loss_of(x).backward()
    expected = {n: p.grad.clone() for n, p in inner.named_parameters()}
    for p in (*inner.parameters(), *head.parameters()):
        p.grad = None
    with graphviz_core.record(tmp_path / "ckpt", steps=1) as rec:
        loss_of(x).backward()
        rec.step()
    for name, p in inner.named_parameters():
        assert torch.equal(p.grad, expected[name])
    (step,) = open_recording(tmp_path / "ckpt").steps()
    assert len(step.backward_graphs) == 1
