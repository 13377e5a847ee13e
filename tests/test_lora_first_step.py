"""LoRA's first step is not a bug (issue 36, "1,000 clean steps: zero findings"): B starts at zero, so A's gradient is
exactly zero until the optimizer moves B. A recorded LoRA loop gives no `no-gradient` finding; where B cannot move
(frozen), A never learns, and that is named at every step with B as the reason."""

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
