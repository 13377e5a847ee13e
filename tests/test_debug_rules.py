"""Rules of gradient-flow debugging (docs/debugging.md) that earlier versions got wrong or left out.

LoRA's first step is not a bug (issue 36, "1,000 clean steps: zero findings"): B starts at zero, so A's gradient is
exactly zero until the optimizer moves B. A recorded LoRA loop gives no `no-gradient` finding; where B cannot move
(frozen), A never learns, and that is named at every step with B as the reason. The path from the loss to a
finding's node; a functional ReLU's dead units, counted by the forward check."""

import pytest
import torch

import graphviz_core
from graphviz_core.analysis.gradient_flow import analyse
from graphviz_core.graph.recording import open_recording


def _lora_model():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return get_peft_model(base, LoraConfig(r=2, target_modules=["0", "2"], lora_alpha=4))


def _train(model, folder, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(1)
    with graphviz_core.record(folder, model=model):
        for _ in range(steps):
            model(torch.randn(6, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return analyse(open_recording(folder))


def test_a_clean_lora_loop_has_no_finding(tmp_path):
    model = _lora_model()
    result = _train(model, tmp_path / "run")
    assert result["findings"] == []
    a = dict(model.named_parameters())["base_model.model.0.lora_A.default.weight"]
    assert a.requires_grad  # A was trainable, and stepped: its first gradient was zero, the next ones were not


def test_a_frozen_b_leaves_a_without_gradient_and_is_named(tmp_path):
    model = _lora_model()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.requires_grad_(False)  # B stays zero: A's gradient stays zero at every step
    findings = _train(model, tmp_path / "run")["findings"]
    names = {f"base_model.model.{m}.lora_A.default.weight" for m in (0, 2)}
    # one finding per parameter over the run: its first step, and on how many steps (all 3) it held
    assert {(f["step"], f["parameter"], f["figures"]["steps"]) for f in findings} == {(0, n, 3) for n in names}
    assert {f["kind"] for f in findings} == {"no-gradient"}
    for f in findings:
        assert f"through {f['parameter'].replace('lora_A', 'lora_B')}, whose values are all zero" in f["reason"]


def test_the_path_from_the_loss_runs_down_to_the_node():
    """A diamond under a root: loss -> a -> c, loss -> b -> d -> c; the shortest path to c is loss, a, c; a node no
    root reaches is its own path."""
    import networkx as nx

    from graphviz_core.analysis.gradient_flow import path_from_loss

    graph = nx.DiGraph([("loss", "a"), ("a", "c"), ("loss", "b"), ("b", "d"), ("d", "c")])
    graph.add_node("alone")
    assert path_from_loss(graph, "c") == ["loss", "a", "c"]
    assert path_from_loss(graph, "d") == ["loss", "b", "d"]
    assert path_from_loss(graph, "loss") == ["loss"] and path_from_loss(graph, "alone") == ["alone"]


class _FunctionalMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 3)

    def forward(self, x):
        return self.down(torch.nn.functional.relu(self.up(x)))  # a functional ReLU: no module of its own


def test_a_functional_relus_dead_units_are_counted_under_the_forward_check(tmp_path):
    """Half of the 32 units after `up` get a bias no input overcomes: F.relu zeroes them for the whole batch. The
    forward check (it sees every torch function) counts them under the module that called F.relu; without it no
    hook sees a functional ReLU, and the step says nothing about it."""
    found = {}
    for check in (True, False):
        torch.manual_seed(0)
        model = _FunctionalMLP()
        with torch.no_grad():
            model.up.bias[:16] = -1e4
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with graphviz_core.record(tmp_path / f"run-{check}", model=model, check_forward=check):
            model(torch.randn(10, 8)).pow(2).mean().backward()
            opt.step()
        found[check] = analyse(open_recording(tmp_path / f"run-{check}"))
    assert found[True]["steps"][0]["dead_units"] == {"(model) (F.relu 1)": 0.5}  # 16 of 32 units, the called one
    assert [(f["kind"], f["module"]) for f in found[True]["findings"]] == [("dead-units", "(model) (F.relu 1)")]
    assert found[False]["steps"][0]["dead_units"] == {} and found[False]["findings"] == []


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_thousand_clean_steps_give_no_finding(tmp_path, dtype):
    """Issue 36's clean run: 1,000 recorded steps of a transformers GPT-2 (2 layers, random weights, AdamW, float32 or
    bfloat16 autocast) give no finding at all, by any of the stated rules, over the whole run."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=61, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(5)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with graphviz_core.record(tmp_path / "run", model=model):
        for _ in range(1000):
            x = torch.randint(0, 61, (3, 12))
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = model(x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    result = analyse(open_recording(tmp_path / "run"))
    assert len(result["steps"]) == 1000
    assert result["findings"] == []


def test_the_picker_places_at_most_a_hundred_findings():
    """A run whose every step after a NaN is a finding (150 here): the picker reads the graphs of the first
    PLACED_AT_MOST (100) only, and places each of them at its own node."""
    import networkx as nx

    from graphviz_core.ui.findings import PLACED_AT_MOST, placed

    graph = nx.DiGraph([("loss", "a")])
    findings = [{"kind": "nonfinite-backward", "step": i, "node_id": "a"} for i in range(150)]
    asked = []
    out = placed(findings, lambda f: asked.append(f["step"]) or graph)
    assert PLACED_AT_MOST == 100 and len(out) == 100 and asked == list(range(100))
    assert all(node == "a" for _, node in out)


def test_a_dead_units_finding_says_how_many_steps_it_held_and_its_worst(tmp_path):
    """A ReLU over a Linear whose weight is zero: each unit's output is relu(its bias) for every row, so a unit with a
    negative bias is zero for the whole batch. 2, then 4, then 2 of the 8 biases negative: 25%, 50%, 25% dead. One
    finding (listed at its first step) that held 3 steps, to step 2, at most 50.0% at step 1; the walkthrough's table
    showed step 2's 12.5% alone where a later step reached 31.25%."""
    from graphviz_core.ui.findings import findings_frame

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # nothing moves: each step's biases are the ones set
    with graphviz_core.record(tmp_path / "run", model=model):
        for dead in (2, 4, 2):
            with torch.no_grad():
                model[0].weight.zero_()
                model[0].bias.copy_(torch.tensor([-1.0] * dead + [1.0] * (8 - dead)))
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    found = [f for f in analyse(open_recording(tmp_path / "run"))["findings"] if f["kind"] == "dead-units"]
    assert len(found) == 1
    f = found[0]
    assert (f["step"], f["fraction"], f["figures"]["steps"], f["figures"]["last_step"]) == (0, 0.25, 3, 2)
    assert f["figures"]["worst"] == {"step": 1, "fraction": 0.5}
    assert f["reason"] == "25.0% of its units were zero for the whole batch (rule: >= 10%); at most 50.0% (step 1)"
    assert findings_frame(found)["steps"].tolist() == ["3 (to step 2)"]
