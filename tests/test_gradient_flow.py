"""Gradient-flow debugging (issue 36) on real recorded loops: a NaN and an Inf injected in one layer's MLP of a
transformers GPT-2 (random weights, config typed here) named at their node, module and source line within their step;
an attention row masked with -inf named at its softmax by the forward check; a detached adapter, an unused head and a
no_grad module named with their reasons; 50% dead units in one layer; B_simple against the same micro-batch gradients
taken by hand; clean float32 and bfloat16 steps give no finding; float16 overflows are the scaler's."""

import functools
import inspect
import json
import math

import pytest
import torch

import graphviz_core
from graphviz_core.analysis.gradient_flow import analyse, finding_node, noise_scale
from graphviz_core.graph.recording import open_recording
from tests import docs_zygote

LAYERS, FAULT_LAYER, STEPS, FAULT_STEP = 12, 7, 38, 37  # the case; no example in the docs uses it


def _gpt2(**extra):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=LAYERS, n_embd=32, n_head=2, vocab_size=61, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **extra)
    torch.manual_seed(5)
    return GPT2LMHeadModel(config)


def _run(model, steps, folder, each=None, check_forward=True, dtype=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with graphviz_core.record(folder, model=model, check_forward=check_forward):
        for step in range(steps):
            if each is not None:
                each(step)
            x = torch.randint(0, 61, (3, 12))
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = model(x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    return analyse(open_recording(folder))


def _inject(model, make):
    """Wrap layer FAULT_LAYER's MLP: `make(out)` added to its output on the fault step only."""
    mlp = model.transformer.h[FAULT_LAYER].mlp
    forward, state = mlp.forward, {"on": False}

    def faulty(hidden):
        out = forward(hidden)
        return out + make(out) if state["on"] else out

    mlp.forward = faulty
    return lambda step: state.update(on=step == FAULT_STEP)


def _nan_fault(out):
    return 0.0 * torch.sqrt(out - out.detach())  # sqrt of an exact zero; its gradient is 0 / (2 * 0) = NaN


def _inf_fault(out):
    # sqrt of an exact zero; its gradient is g / (2 * 0) = +-inf, no NaN where g is not 0. GPT-2's loss predicts
    # token t+1 from position t: the last position's gradient is exactly 0 (0 / 0 = NaN), so it is left out
    zero = out - out.detach()
    return torch.cat([torch.sqrt(zero[:, :-1]), zero[:, -1:]], dim=1)


def _line_of(function, text):
    lines, first = inspect.getsourcelines(function)
    return f"{__file__}:{first + next(i for i, line in enumerate(lines) if text in line)}"


@pytest.mark.parametrize("fault, values, positions", [(_nan_fault, "nan", 12), (_inf_fault, "inf", 11)])
def test_a_sqrt_of_zero_in_one_mlp_is_named_at_its_node_module_and_line(tmp_path, fault, values, positions):
    model = _gpt2()
    result = _run(model, STEPS, tmp_path / "run", each=_inject(model, fault))
    backward = [f for f in result["findings"] if f["kind"] == "nonfinite-backward"]
    assert len(backward) == 1, backward  # the steps before it are clean; the loss of the fault step is finite
    found = backward[0]
    assert found["step"] == FAULT_STEP and found["rank"] == 0
    assert found["node"] == "SqrtBackward0" and found["module"] == f"transformer.h.{FAULT_LAYER}.mlp"
    assert found["source"] == _line_of(fault, "torch.sqrt")
    assert found["figures"]["values"] == values
    # the gradient it received was finite (0 for the NaN fault: 0 * sqrt sends it zeros), its output is not: every
    # one of the 3 sequences x positions x 32 values of the sqrt's input (0/0 or g/0)
    assert all(g["nonfinite"] == 0 for g in found["figures"]["grad_in"])
    assert found["figures"]["nonfinite"] == 3 * positions * 32
    # every gradient in and out of it is the sqrt's input's shape: 3 sequences x `positions` x width 32, float32; the
    # tensor it saved is its result, sqrt(0) = 0 at every one of those values (read while the node held it)
    shape = [3, positions, 32]
    assert [(g["shape"], g["dtype"]) for g in found["figures"]["grad_in"]] == [(shape, "float32")]
    assert [(g["shape"], g["dtype"]) for g in found["figures"]["grad_out"]["gradients"]] == [(shape, "float32")]
    assert found["figures"]["saved"] == [{"name": "result", "shape": shape, "dtype": "float32", "min": 0.0,
                                          "max": 0.0, "nonfinite": 0}]
    assert not [f for f in result["findings"] if f["kind"] in ("nonfinite-forward", "nonfinite-loss")]


class _Scaled(torch.nn.Module):
    """A linear layer, then sqrt(scale * h) - sqrt(0) where scale is 0 on the fault step - then a second layer."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.scale = torch.nn.Linear(6, 5), torch.nn.Linear(5, 2), 1.0

    def forward(self, x):
        return self.b(torch.sqrt(self.scale * self.a(x).abs()))


def test_a_findings_shapes_are_its_own_steps_when_batches_change_size(tmp_path):
    """The graph is stored once (same ops and edges at every batch size); the gradients' shapes are per step: a fault
    at step 2, whose batch has 3 rows where steps 0 and 1 had 7, reads 3 rows."""
    torch.manual_seed(3)
    model = _Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with graphviz_core.record(tmp_path / "run", model=model):
        for step, rows in enumerate((7, 7, 3)):
            model.scale = 0.0 if step == 2 else 1.0
            model(torch.randn(rows, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
    recording = open_recording(tmp_path / "run")
    assert len({g for s in recording.steps() for g in s.backward_graphs}) == 1  # one graph for both sizes
    found = [f for f in analyse(recording)["findings"] if f["kind"] == "nonfinite-backward"]
    assert [(f["step"], f["node"]) for f in found] == [(2, "SqrtBackward0")]
    figures = found[0]["figures"]
    # sqrt's input is scale * |a(x)|: rows x 5 features; what it saved is its result, sqrt(0) = 0 everywhere
    assert [g["shape"] for g in figures["grad_in"]] == [[3, 5]]
    assert [g["shape"] for g in figures["grad_out"]["gradients"]] == [[3, 5]]
    assert [(v["shape"], v["min"], v["max"]) for v in figures["saved"]] == [([3, 5], 0.0, 0.0)]
    lines = [json.loads(line) for line in (tmp_path / "run" / "rank-0" / "debug.jsonl").read_text().splitlines()]
    assert len([line for line in lines if "key" in line]) == 2  # one shapes line per size, not per step


class _Split(torch.nn.Module):
    """x split in two, the halves multiplied: mm(x[:2], x[2:]) * 1e30. Rows 0-1 hold 1e10, rows 2-4 1e-20: forward
    every value is finite (mm: 3 x 1e10 x 1e-20 = 3e-10, then 3e20); backward the mm receives 1e30 (finite) and
    returns b's gradient a^T @ g = 2 x 1e10 x 1e30 = 2e40, past float32's 3.4e38: inf, both of its gradients sent to
    the one split node."""

    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(torch.cat([torch.full((2, 3), 1e10), torch.full((3, 3), 1e-20)]))

    def forward(self):
        a, b = self.x.split([2, 3])
        return (torch.mm(a, b) * 1e30).sum()


def test_two_gradients_sent_to_one_node_are_each_listed_with_its_shape(tmp_path):
    model = _Split()
    with graphviz_core.record(tmp_path / "run", model=model) as rec:
        model().backward()
        rec.step()
    [found] = [f for f in analyse(open_recording(tmp_path / "run"))["findings"] if f["kind"] == "nonfinite-backward"]
    assert found["node"] == "MmBackward0" and found["figures"]["values"] == "inf"
    sent = found["figures"]["grad_out"]["gradients"]
    assert {g["to"].partition(":")[0] for g in sent} == {"SplitWithSizesBackward0"}
    assert sorted(g["shape"] for g in sent) == [[2, 3], [3, 3]]  # a's gradient and b's: both halves of x
    # the page's table: the recorder keeps one count for all the node returned, shown once beside both shapes: b's
    # gradient is inf at all 3 x 3 values (2 x 1e10 x 1e30 each), a's finite (3 x 1e-20 x 1e30 = 3e10 each)
    from graphviz_core.ui.findings import gradients_frame

    frame = gradients_frame(found).set_index("what")
    assert frame.loc["all 2 gradients it returned", "NaN or inf values"] == "9"
    returned = frame[frame.index.str.startswith("gradient returned to")]
    assert sorted(returned["shape"]) == ["(2, 3)", "(3, 3)"] and set(returned["NaN or inf values"]) == {""}


def test_a_sparse_tensor_saved_at_the_source_is_listed_and_the_backward_runs(tmp_path):
    """sparse.mm(s, w) with an inf in the sparse s: w's gradient s^T @ g is inf where g is finite. The tensor saved
    for it is sparse (no values are read from it: its shape alone); the user's backward runs as it would unrecorded."""
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 2, bias=False)
    sparse = torch.sparse_coo_tensor([[0, 1], [1, 2]], [float("inf"), 1.0], (4, 3))
    with graphviz_core.record(tmp_path / "run", model=model) as rec:
        torch.sparse.mm(sparse, model.weight.t()).sum().backward()
        rec.step()
    assert not math.isfinite(float(model.weight.grad.abs().max()))  # the backward ran to the end
    [found] = [f for f in analyse(open_recording(tmp_path / "run"))["findings"] if f["kind"] == "nonfinite-backward"]
    assert any(v["shape"] == [4, 3] and v["min"] is None for v in found["figures"]["saved"]), found["figures"]["saved"]


class _Attention(torch.nn.Module):
    def __init__(self, width, masked=False):
        super().__init__()
        self.qkv, self.out, self.masked = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width), masked

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        mask = torch.zeros_like(scores)
        if self.masked:
            mask[:, 2, :] = float("-inf")  # every key of query 2 masked: that row's softmax is 0 / 0
        weights = torch.softmax(scores + mask, dim=-1)
        return x + self.out(weights @ v)


def test_forward_check_names_the_softmax_of_a_fully_masked_row(tmp_path):
    torch.manual_seed(6)
    model = torch.nn.Sequential(*[_Attention(16, masked=i == 2) for i in range(4)], torch.nn.Linear(16, 1))
    with graphviz_core.record(tmp_path / "run", model=model, check_forward=True) as rec:
        loss = model(torch.randn(2, 5, 16)).pow(2).mean()
        loss.backward()
        rec.step()
    findings = analyse(open_recording(tmp_path / "run"))["findings"]
    forward = [f for f in findings if f["kind"] == "nonfinite-forward"]
    assert len(forward) == 1  # the -inf of the mask is not a finding (the loss's NaN came from the softmax)
    assert forward[0]["node"] == "softmax" and forward[0]["module"] == "2"
    assert forward[0]["source"] == _line_of(_Attention.forward, "torch.softmax")
    # one row of 5 keys in each of the 2 sequences is NaN; the matmul and Linear after it only carry it on
    assert forward[0]["figures"]["nan"] == 2 * 5
    assert [f["reason"] for f in findings if f["kind"] == "nonfinite-loss"] == ["the loss is nan"]
    # placed at the node the softmax made in the step's graph (the page opens it there): SoftmaxBackward0, whose
    # forward source line is the softmax's
    recording = open_recording(tmp_path / "run")
    graph = recording.step_graph(0, 0, forward[0]["backward"])
    node = finding_node(graph, forward[0])
    assert node == forward[0]["node_id"] and graph.nodes[node]["op"] == "SoftmaxBackward0"
    assert forward[0]["backward"] == 0


class _Adapted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base, self.adapter = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.head, self.unused_head, self.frozen_path = torch.nn.Linear(8, 1), torch.nn.Linear(8, 3), \
            torch.nn.Linear(8, 8)
        self.zero = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.base(x) + self.adapter(x).detach()
        with torch.no_grad():
            side = self.frozen_path(x)
        h = h + side
        h = h + 0.0 * self.zero(x).clamp(min=1e6)  # every value clamped to a constant: a zero gradient
        return self.head(h)


def sgd_steps(folder, model, batch, steps: int = 2) -> None:
    """`steps` recorded SGD steps (lr 0.1) on the mean square of the model's output for a fresh `batch()`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graphviz_core.record(folder, model=model):
        for _ in range(steps):
            model(batch()).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()


def test_parameters_without_a_gradient_are_named_with_their_reasons(tmp_path):
    torch.manual_seed(7)
    model = _Adapted()
    sgd_steps(tmp_path / "run", model, lambda: torch.randn(4, 8))
    findings = [f for f in analyse(open_recording(tmp_path / "run"))["findings"] if f["kind"] == "no-gradient"]
    reasons = {f["parameter"]: f["reason"] for f in findings}
    assert set(reasons) == {f"{m}.{p}" for m in ("adapter", "unused_head", "frozen_path", "zero")
                            for p in ("weight", "bias")}
    assert reasons["adapter.weight"].startswith("cut by detach: the output of adapter was detached")
    assert reasons["unused_head.bias"] == "not on any path from the loss: unused_head never ran in this step's forward"
    assert reasons["frozen_path.weight"].startswith("computed under no_grad")
    assert reasons["zero.weight"].startswith("its gradient is exactly zero")
    assert all(f["step"] == 0 and f["figures"]["steps"] == 2 for f in findings)  # one finding each, over 2 steps
    # The cut placed where it happens: the node the cut output entered (the first node made after the cut with an input
    # that needs no gradient). adapter: `base(x) + adapter(x).detach()`, the add beside base's matmul; frozen_path:
    # `h + side`, the next add, taking the first; the unused head never ran and has no place.
    by_name = {f["parameter"]: f for f in findings}
    graph = open_recording(tmp_path / "run").step_graph(0)
    adapter, frozen = by_name["adapter.weight"]["node_id"], by_name["frozen_path.weight"]["node_id"]
    assert graph.nodes[adapter]["op"] == graph.nodes[frozen]["op"] == "AddBackward0" and adapter != frozen
    assert [graph.nodes[c]["module"] for c in graph.successors(adapter)] == ["base"]
    assert list(graph.successors(frozen)) == [adapter]
    assert reasons["adapter.weight"].endswith("before the loss; it entered the graph at AddBackward0")
    assert "node_id" not in by_name["unused_head.weight"]
    assert by_name["adapter.bias"]["node_id"] == adapter  # one cut, both its parameters


def test_half_the_units_of_one_mlp_dead(tmp_path):
    model = _gpt2(activation_function="relu")
    units = 4 * 32
    with torch.no_grad():  # half of layer FAULT_LAYER's c_fc units get a bias no input overcomes
        model.transformer.h[FAULT_LAYER].mlp.c_fc.bias[: units // 2] = -1e4
    result = _run(model, 1, tmp_path / "run", check_forward=False)
    dead = result["steps"][0]["dead_units"]
    assert set(dead) == {f"transformer.h.{i}.mlp.act" for i in range(LAYERS)}
    assert abs(dead[f"transformer.h.{FAULT_LAYER}.mlp.act"] - 0.5) <= 0.01
    assert all(v < 0.01 for k, v in dead.items() if k != f"transformer.h.{FAULT_LAYER}.mlp.act")
    found = [f for f in result["findings"] if f["kind"] == "dead-units"]
    assert [(f["module"], f["step"]) for f in found] == [(f"transformer.h.{FAULT_LAYER}.mlp.act", 0)]


def test_noise_scale_equals_the_offline_estimate_from_the_same_micro_batches(tmp_path):
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    k, b, offline = 4, 5, []
    with graphviz_core.record(tmp_path / "run", model=model):
        for _ in range(3):
            micro = []  # each micro-batch's own mean-loss gradient, flattened, taken by hand
            for _ in range(k):
                x, y = torch.randn(b, 6), torch.randn(b, 1)
                before = torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
                                    for p in model.parameters()])
                (torch.nn.functional.mse_loss(model(x), y) / k).backward()
                after = torch.cat([p.grad.flatten() for p in model.parameters()])
                micro.append((after - before) * k)
            # McCandlish et al., appendix A.1, in examples: B_small = b, B_big = k b
            small = sum(float(g.pow(2).sum()) for g in micro) / k
            big = float((sum(micro) / k).pow(2).sum())
            g2 = (k * b * big - b * small) / (k * b - b)
            s = (small - big) / (1 / b - 1 / (k * b))
            offline.append(s / g2 / b)  # B_simple in examples, divided by b examples per micro-batch
            opt.step()
            opt.zero_grad()
    figures = analyse(open_recording(tmp_path / "run"))["steps"]
    assert [f["micro_batches"] for f in figures] == [k] * 3
    for recorded, expected in zip([f["noise_scale"] for f in figures], offline, strict=True):
        assert math.isclose(recorded, expected, rel_tol=1e-3)
    assert noise_scale([1.0], 1.0) is None  # one micro-batch: nothing to estimate from


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_clean_steps_give_no_finding(tmp_path, dtype):
    result = _run(_gpt2(), 6, tmp_path / "run", dtype=dtype)
    assert result["findings"] == []
    assert result["forward_checked"] == [0]


def test_float16_overflows_are_the_scalers(tmp_path):
    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # float16's largest value is 65,504: a loss scaled by 2**24 overflows in the float16 backward, and the scaler
    # halves its scale and skips each step until the gradients fit
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    with graphviz_core.record(tmp_path / "run", model=model):
        for _ in range(12):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    recording = open_recording(tmp_path / "run")
    skipped = [s for s in recording.steps() if s.skipped]
    assert skipped and len(skipped) < 12
    findings = analyse(recording)["findings"]
    assert [f["kind"] for f in findings] == ["scaler-overflow"] * len(skipped)
    for step, found in zip(skipped, findings, strict=True):
        assert found["step"] == step.step
        assert found["reason"] == f"scaler overflow (scale = {step.scale:g}), step skipped"
        # where the float16 gradient first overflowed, named for the view (not a NaN source: no other finding)
        assert found["node"] in {d["op"] for _, d in recording.step_graph(step.step).nodes(data=True)}
        assert found["figures"]["nonfinite"] > 0


def _cli(*args):
    return docs_zygote.run_cli(["debug", *args], timeout=300)


def _cli_here(capsys, *args):
    """`graphviz-core debug ARGS` in this process (cli.main), as (returncode, stdout, stderr)."""
    from types import SimpleNamespace

    from graphviz_core.cli import main

    capsys.readouterr()
    try:
        code = main(["debug", *args])
    except SystemExit as stop:  # --help
        code = stop.code
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_cli_prints_findings_and_refuses_bad_input(tmp_path, capsys):
    model = _gpt2()
    _run(model, STEPS, tmp_path / "run", each=_inject(model, _inf_fault))
    done = _cli(str(tmp_path / "run"), "--format", "json")  # a real process: the contract's exit status and stdout
    assert done.returncode == 0, done.stderr
    assert [f["node"] for f in json.loads(done.stdout)["findings"]] == ["SqrtBackward0"]
    listing = docs_zygote.run_cli(["--help"])
    assert "gradient-flow findings of a recording" in listing.stdout
    here = functools.partial(_cli_here, capsys)  # the rest in this process: the same main, without 3 s of imports
    assert "Gradient-flow findings: where a NaN" in here("--help").stdout  # the subcommand's own help
    clean = here("--preset", "gpt2-tiny", "--layers", "1", "--format", "json")
    assert clean.returncode == 0 and json.loads(clean.stdout)["findings"] == []
    assert json.loads(clean.stdout)["forward_checked"] == []
    checked = here("--preset", "gpt2-tiny", "--layers", "1", "--check-forward")
    assert json.loads(checked.stdout)["forward_checked"] == [0]  # the flag records source lines
    compiled = here("--preset", "mlp", "--compile")  # a compiled step (AOTAutograd's regions): a clean one
    assert compiled.returncode == 0 and json.loads(compiled.stdout)["findings"] == [], compiled.stderr
    by_fields = here("--model", "mlp", "--hidden", "16")  # --model and its flags, as `graph` takes them (was refused)
    assert by_fields.returncode == 0 and json.loads(by_fields.stdout)["config"]["hidden"] == 16, by_fields.stderr
    for args, said in (([str(tmp_path / "none")], "does not exist"),
                       ([], "give a recording's folder"),
                       ([str(tmp_path / "run"), "--check-forward"], "--check-forward applies to --preset"),
                       ([str(tmp_path / "run"), "--preset", "gpt2-tiny"], "not both"),
                       (["--preset", "gpt2-tiny", "--device", "meta"], "shapes only"),
                       (["--preset", "gpt2-tiny", "--optimizer", "sgd"], "no optimizer step")):
        refused = here(*args)
        assert refused.returncode == 2 and said in refused.stderr and len(refused.stderr.splitlines()) == 1, args


def test_record_check_forward_flag_keeps_source_lines(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor _ in range(2):\n"
                      "    model(torch.randn(3, 4)).pow(2).mean().backward()\n    opt.step()\n    opt.zero_grad()\n")
    for flag, checked in (([], []), (["--check-forward"], [0])):
        folder = tmp_path / f"run{len(flag)}"
        done = docs_zygote.run_cli(["record", *flag, "-o", str(folder), str(script)], timeout=300)
        assert done.returncode == 0, done.stderr
        assert analyse(open_recording(folder))["forward_checked"] == checked
    refused = docs_zygote.run_cli(["record", "--check-forward", "--parameters-only", "-o", str(tmp_path / "x"),
                                   str(script)], timeout=300)
    assert refused.returncode == 2 and "check_forward needs the per-node figures" in refused.stderr


def test_a_lora_preset_step_names_each_a_beside_its_zero_b():
    """llama-tiny with LoRA on q_proj and v_proj of its 2 layers, under bfloat16 autocast: B starts at zero, so each
    of the 4 A matrices gets an exactly zero gradient on the first step, named with B; the frozen base weights
    (requires_grad=False) are not findings."""
    from graphviz_core.analysis.gradient_flow import analyse_config
    from graphviz_core.config import resolve_config

    findings = analyse_config(resolve_config("llama-tiny", finetune="lora", autocast="bfloat16"))["findings"]
    expected = {f"model.layers.{i}.self_attn.{p}_proj.lora_A.default.weight" for i in (0, 1) for p in "qv"}
    assert {f["parameter"] for f in findings} == expected and {f["kind"] for f in findings} == {"no-gradient"}
    for f in findings:
        assert f"through {f['parameter'].replace('lora_A', 'lora_B')}, whose values are all zero" in f["reason"]


def _ddp_rank(rank, world, port, folder, results):
    from tests.gloo import gloo_group

    with gloo_group(rank, world, port):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                                                              torch.nn.Linear(8, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(10 + rank)
        with graphviz_core.record(folder, model=model.module, check_forward=True):
            for step in range(2):
                out = model(torch.randn(3, 4))
                if rank == 1 and step == 1:
                    out = out + _nan_fault(out)  # rank 1's own loss, at its last step
                out.pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        if rank == 0:
            results.put(None)


def test_the_rank_that_produced_the_nan_is_named(tmp_path):
    """Two real gloo processes under DistributedDataParallel; rank 1 alone takes the sqrt of an exact zero at step 1.
    Its backward is named there; rank 0's own nodes stayed finite (DDP averages the gradients into .grad after the
    nodes ran), so rank 0 has no nonfinite-backward finding."""
    from tests.gloo import spawn_ranks

    spawn_ranks(_ddp_rank, 2, str(tmp_path / "ddp"))
    findings = [f for f in analyse(open_recording(tmp_path / "ddp"))["findings"] if f["kind"] == "nonfinite-backward"]
    assert [(f["rank"], f["step"], f["node"]) for f in findings] == [(1, 1, "SqrtBackward0")]
    assert findings[0]["source"] == _line_of(_nan_fault, "torch.sqrt")


def test_exploding_and_vanishing_by_their_stated_rules(tmp_path):
    """Steps 0-6 train a small model; step 7's loss is multiplied by 1,000, so its whole gradient norm is ~1,000x
    the median of the 7 before it (rule: > 10x). Module `tiny`'s output enters the model multiplied by 1e-7, so its
    parameters' gradient norm is ~1e-7 of the others' (rule: < 1e-4 of the largest module's)."""
    torch.manual_seed(11)
    body, tiny, head = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 1)
    model = torch.nn.ModuleDict({"body": body, "tiny": tiny, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with graphviz_core.record(tmp_path / "run", model=model):
        for step in range(8):
            x = torch.randn(8, 6)
            loss = head(torch.tanh(body(x) + 1e-7 * tiny(x))).pow(2).mean() * (1000.0 if step == 7 else 1.0)
            loss.backward()
            opt.step()
            opt.zero_grad()
    recording = open_recording(tmp_path / "run")
    findings = analyse(recording)["findings"]
    exploding = [f for f in findings if f["kind"] == "exploding"]
    assert [f["step"] for f in exploding] == [7]
    norms = [s.grad_norm for s in recording.steps()]
    ratio = norms[7] / sorted(norms[:7])[3]  # the median of 7 steps is the 4th smallest
    assert f"is {ratio:.1f}x the median" in exploding[0]["reason"] and ratio > 100
    vanishing = [f for f in findings if f["kind"] == "vanishing"]
    assert [(f["module"], f["step"], f["figures"]["steps"]) for f in vanishing] == [("tiny", 0, 8)]
    assert vanishing[0]["fraction"] < 1e-5
    assert {f["kind"] for f in findings} == {"exploding", "vanishing"}
    # two ranks with the same figures (DDP: each rank steps with the same averaged gradient): each rank's own findings,
    # each held as many steps as on one rank (keyed without the rank, step 7 read "2 steps" and tiny "16", rank 1 none)
    import shutil

    shutil.copytree(tmp_path / "run" / "rank-0", tmp_path / "run" / "rank-1")
    both = [(f["kind"], f["rank"], f["step"], f["figures"]["steps"]) for f in analyse(open_recording(tmp_path / "run"))
            ["findings"]]
    assert sorted(both) == [("exploding", 0, 7, 1), ("exploding", 1, 7, 1), ("vanishing", 0, 0, 8),
                            ("vanishing", 1, 0, 8)]


def _tampered(tmp_path, name, change):
    import shutil

    folder = tmp_path / name
    shutil.copytree(tmp_path / "base", folder)
    log = folder / "rank-0" / "debug.jsonl"
    change(log)
    return folder


def test_a_damaged_or_hostile_debug_log_is_one_sentence(tmp_path, capsys):
    """Read by `graphviz-core debug` in this process (the exit status and stderr of a real one: the test above)."""
    here = functools.partial(_cli_here, capsys)
    torch.manual_seed(12)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    sgd_steps(tmp_path / "base", model, lambda: torch.randn(16, 4))
    lines = (tmp_path / "base" / "rank-0" / "debug.jsonl").read_text().splitlines()
    assert len(lines) == 4  # the parameters line, the graph's shapes (both steps have the same), one line per step

    def step_line(**fields):
        return lambda log: log.write_text("\n".join([*lines[:2], json.dumps({"step": 1, **fields})]) + "\n")

    cut = _tampered(tmp_path, "cut", lambda log: log.write_text("\n".join(lines)[:-7]))  # a killed run's last line
    assert here(str(cut)).returncode == 0
    for name, change, said in (
            ("middle", lambda log: log.write_text("\n".join([lines[0], "{not json", lines[2]]) + "\n"), "not JSON"),
            ("list", lambda log: log.write_text("\n".join([lines[0], "[1, 2]", lines[2]]) + "\n"), "not an object"),
            ("parameter", step_line(no_gradient=[{"parameter": {"a": 1}}]), "wrong type"),
            ("units", step_line(dead_units={"0": [5, 2]}), "wrong type"),
            ("producer", step_line(forward={"nan": {"op": 3}}), "wrong type"),
            ("shape keys", step_line(link_shapes=[3]), "wrong type"),
            ("saved values", step_line(saved_values=[{"2": [{"name": "result", "shape": [-1]}]}]), "wrong type"),
            # JSON's NaN and 1e999 are read as floats, an integer may pass a float's range: each refused by name
            ("saved nan", step_line(saved_values=[{"2": [{"name": "r", "shape": [1], "min": float("nan")}]}]),
             "wrong type"),
            ("saved huge", step_line(saved_values=[{"2": [{"name": "r", "shape": [1], "max": 10 ** 400}]}]),
             "wrong type"),
            ("producer shapes", step_line(forward={"nan": {"op": "sqrt", "inputs": [[float("nan")]]}}), "wrong type"),
            ("shapes", lambda log: log.write_text("\n".join([lines[0], json.dumps(
                {"link_shapes": "abc", "key": "k", "shapes": [["a"]], "dtypes": [None]}), *lines[2:]]) + "\n"),
             "wrong type"),
            ("dims", lambda log: log.write_text("\n".join([lines[0], json.dumps(
                {"link_shapes": "abc", "key": "k", "shapes": [[1] * 100], "dtypes": [None]}), *lines[2:]]) + "\n"),
             "wrong type")):
        done = here(str(_tampered(tmp_path, name, change)))
        assert done.returncode == 2 and said in done.stderr and len(done.stderr.splitlines()) == 1, (name, done.stderr)
    link = tmp_path / "link"
    import shutil

    shutil.copytree(tmp_path / "base", link)
    (link / "rank-0" / "debug.jsonl").unlink()
    (link / "rank-0" / "debug.jsonl").symlink_to(tmp_path / "base" / "rank-0" / "debug.jsonl")
    done = here(str(link))
    assert done.returncode == 2 and "not a plain file" in done.stderr


def test_update_ratio_per_module_is_lr_times_gradient_over_weight_for_sgd(tmp_path):
    """Plain SGD's update is lr * g, so a module's |update| / |weight| over its weight and bias together is
    lr * sqrt(|g_w|^2 + |g_b|^2) / sqrt(|w|^2 + |b|^2), taken here by hand before each step."""
    torch.manual_seed(14)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    lr, by_hand = 0.03, []
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with graphviz_core.record(tmp_path / "run", model=model):
        for _ in range(2):
            model(torch.randn(4, 5)).pow(2).mean().backward()
            by_hand.append({m: lr * math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model[int(m)].parameters()))
                            / math.sqrt(sum(float(p.detach().pow(2).sum()) for p in model[int(m)].parameters()))
                            for m in ("0", "2")})
            opt.step()
            opt.zero_grad()
    for figures, expected in zip(analyse(open_recording(tmp_path / "run"))["steps"], by_hand, strict=True):
        assert set(figures["update_ratio"]) == {"0", "2"}
        for module, ratio in expected.items():
            assert math.isclose(figures["update_ratio"][module], ratio, rel_tol=1e-5)


class _FailsOnce(torch.autograd.Function):
    """Identity forward; its backward raises the first time it runs."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _FailsOnce.calls += 1
        if _FailsOnce.calls == 1:
            raise RuntimeError("a backward the user catches")
        return g


def test_a_backward_that_raises_leaves_the_next_ones_figures_beside_their_own_graph(tmp_path):
    """The step's first backward raises and the loop catches it; its second, through a different graph (a sqrt of an
    exact zero on 4 x 5 values), is the step's only recorded backward: its finding reads its own shapes, not the failed
    one's (that graph's input was 7 x 5)."""
    model = torch.nn.Linear(5, 5)
    with graphviz_core.record(tmp_path / "run", model=model) as rec:
        with pytest.raises(RuntimeError, match="the user catches"):
            _FailsOnce.apply(model(torch.randn(7, 5))).sum().backward()
        h = model(torch.randn(4, 5))
        (h + 0.0 * torch.sqrt(h - h.detach())).sum().backward()
        rec.step()
    recording = open_recording(tmp_path / "run")
    assert len(recording.steps()[0].backward_graphs) == 1
    [found] = [f for f in analyse(recording)["findings"] if f["kind"] == "nonfinite-backward"]
    assert found["node"] == "SqrtBackward0"
    assert [g["shape"] for g in found["figures"]["grad_in"]] == [[4, 5]]
    assert [v["shape"] for v in found["figures"]["saved"]] == [[4, 5]]


def test_eager_needs_torch_compilers_set_stance(tmp_path, monkeypatch):
    monkeypatch.delattr(torch.compiler, "set_stance")
    with pytest.raises(ValueError, match="new in torch 2.6"):
        with graphviz_core.record(tmp_path / "run", eager=True):
            pass


def test_memory_nobody_wrote_yet_is_not_a_nan_made_by_the_forward(tmp_path):
    """`torch.empty` returns whatever bytes its memory held, a NaN among them now and then: a layer built inside the
    recording (nn.Linear makes its weight with torch.empty, then fills it in place) once gave a clean script a
    nonfinite-forward finding at `empty`, about one recording of docs/debugging.md's example in twelve. Here the
    memory is made to hold NaNs first (freed, then taken again by torch.empty: CPU malloc hands a freed block of
    the same size back, about 2 times in 3 here), and the model is built and trained inside the recording."""
    model = None
    with graphviz_core.record(tmp_path / "run", check_forward=True) as rec:
        for _ in range(200):  # until torch.empty is seen handing back NaNs (each try about 2 in 3)
            with torch.no_grad():  # (outside the check: no_grad)
                stale = torch.full((16 * 8,), float("nan"))
                del stale
            reused = torch.empty(16 * 8)  # checked: the op the finding named
            if torch.isnan(reused).any():
                break
        assert torch.isnan(reused).any()  # the case this test is about happened
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        rec.step()
    findings = analyse(open_recording(tmp_path / "run"))["findings"]
    assert [f for f in findings if f["kind"].startswith("nonfinite")] == []


def test_the_debug_tab_refuses_a_checkpointed_config_in_the_forms_words():
    """The Debug tab's refusal named a command-line flag ("leave out --checkpoint", a walkthrough); it names the form's
    field now, as the CLI's sentence still names its flag."""
    from tests.conftest import explorer_tab, plain

    at = explorer_tab("Debug", preset="gpt2-tiny", checkpoint="full")
    said = " ".join(plain(i.value) for i in at.info)
    assert not at.exception and "without activation checkpointing: “Checkpointing” set to none" in said, said
    assert "--" not in said


def test_an_all_zero_gradient_reads_0_and_a_redrawn_graph_keeps_one_row_each(tmp_path):
    """A walkthrough read "max |value| of its gradient -0" (LoRA's A matrices, whose gradient is zero while B is) and
    the same three rows twice in the node's details after a rerun. A Linear fed zeros: its weight's gradient is
    dL/dW = dL/dy^T x = 0 for every entry, so max |value| = max(-min, max) = max(-0.0, 0.0), which Python's max
    returned as -0.0 (the first of equals)."""
    from streamlit.testing.v1 import AppTest

    from graphviz_core.ui.findings import _figure

    model = torch.nn.Linear(3, 1)
    with graphviz_core.record(tmp_path / "run", model=model):
        model(torch.zeros(2, 3)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    recording = open_recording(tmp_path / "run")
    graph = recording.step_graph(0)
    weight = next(d for _, d in graph.nodes(data=True) if (d.get("param") or {}).get("name") == "weight")
    assert weight["max_abs"] == 0.0 and math.copysign(1.0, weight["max_abs"]) == 1.0  # +0.0, not -0.0
    assert (weight["min"], weight["max"]) == (0.0, 0.0)
    assert _figure(-0.0) == "0" and _figure(None) == "n/a" and _figure(0.012345) == "0.01235"

    def page(folder: str) -> None:
        from graphviz_core.graph.recording import open_recording
        from graphviz_core.ui.findings import show_recorded_graph

        graph = open_recording(folder).step_graph(0)  # as the page gets it: one object for every rerun
        show_recorded_graph(graph, None, "grad_norm", title="t", subtitle="s")
        show_recorded_graph(graph, None, "grad_norm", title="t", subtitle="s")
        import streamlit as st

        st.text(str(sorted({len(d.get("details", [])) for _, d in graph.nodes(data=True)})))

    at = AppTest.from_function(page, args=(str(tmp_path / "run"),)).run()
    assert not at.exception and at.text[0].value == "[0]"  # the graph handed in is never written on


def test_after_an_update_writes_nan_into_the_weights_later_steps_say_so():
    """Step 1's loss is NaN (sqrt of a negative number, made in the forward); plain SGD then writes NaN into every
    weight the NaN gradient reached (w - lr * NaN = NaN), so steps 2 and 3 start from NaN weights. A walkthrough read
    "the forward made it (see the nonfinite-loss and nonfinite-forward findings)" at those steps, where no forward
    finding exists (recorded without the forward check) and the forward was not where it started."""
    import tempfile

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tempfile.TemporaryDirectory() as folder:
        with graphviz_core.record(f"{folder}/run", model=model):
            for step in range(4):
                out = model(torch.randn(2, 3)).sum()
                (out - 1e6).sqrt().backward() if step == 1 else out.pow(2).backward()
                opt.step()
                opt.zero_grad()
        findings = analyse(open_recording(f"{folder}/run"))["findings"]
    reasons = {f["step"]: f["reason"] for f in findings if f["kind"] == "nonfinite-backward"}
    assert reasons[1] == "the loss was already non-finite: the forward made it (see the nonfinite-loss finding)"
    for step in (2, 3):  # both layers' weights and biases got NaN gradients at step 1: "0.bias, 0.weight, 1.bias and 1 more"
        assert reasons[step] == ("the loss was already non-finite: the weights 0.bias, 0.weight, 1.bias and 1 more "
                                 "already held a NaN or inf before this step's forward (written by the update of step 1)")


def test_a_nan_gradient_on_a_step_without_node_figures_is_still_a_finding(tmp_path):
    """Per-node figures on steps 0 and 2 only (nodes_every=2); step 1's loss is sqrt(-1) = NaN, so every parameter's
    gradient is NaN there. That step has no graph, so no node can be named, but its per-parameter figures hold the NaN:
    an outside audit found no finding at all for it. Step 1 is a finding naming the parameters; the SGD update then
    writes NaN into all four, so step 2, with its graph, is the usual placed finding, and step 3, without one, says the
    weights held the NaN since step 1's update (not "record per-node figures to find it", which would find nothing)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with graphviz_core.record(tmp_path / "run", model=model, nodes_every=2):
        for step in range(4):
            out = model(torch.randn(2, 3)).sum()
            (out * 0 - 1).sqrt().backward() if step == 1 else out.pow(2).backward()
            opt.step()
            opt.zero_grad()
    recording = open_recording(tmp_path / "run")
    assert [bool(s.backward_graphs) for s in recording.steps()] == [True, False, True, False]
    found = [f for f in analyse(recording)["findings"] if f["kind"] == "nonfinite-backward"]
    assert [(f["step"], f.get("parameter"), "node" in f) for f in found] == [(1, "0.bias", False), (2, None, True),
                                                                           (3, "0.bias", False)]
    assert found[3 - 1]["reason"].endswith("already held a NaN or inf before this step's forward (written by the "
                                           "update of step 1)")
    assert found[0]["figures"]["parameters"] == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert found[0]["reason"].startswith("the gradient of 0.bias, 0.weight, 1.bias and 1 more held a NaN or inf; this "
                                         "step was recorded without per-node figures")
