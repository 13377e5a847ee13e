"""Gradient-flow debugging of a torch.compile'd model (issue 36 item 5): a NaN started inside a compiled region is
placed at that region's node (CompiledFunctionBackward: the compiled ops are one node of the recorded graph) and at
the parameters the region sent it to."""

import torch

import graphviz_core
from graphviz_core.analysis.gradient_flow import analyse
from graphviz_core.graph.recording import open_recording
from tests import docs_zygote


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def forward(self, x, fault: bool):
        h = torch.tanh(self.a(x))
        if fault:  # a Python flag: dynamo compiles the faulty step as a graph of its own
            h = h + 0.0 * torch.sqrt(h - h.detach())  # the square root of an exact zero: its gradient is NaN
        return self.b(h)


def test_a_nan_in_a_compiled_region_is_placed_at_the_region_and_its_parameters(tmp_path):
    torch.manual_seed(0)
    model = _Model()
    compiled = torch.compile(model, backend="aot_eager")  # AOTAutograd's region, no C++ compiler needed
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graphviz_core.record(tmp_path / "run", model=model):
        for step in range(3):
            out = compiled(torch.randn(6, 8), step == 2)  # the last step: no NaN reaches the weights before it
            torch.nn.functional.cross_entropy(out, torch.randint(0, 3, (6,))).backward()
            opt.step()
            opt.zero_grad()
    findings = analyse(open_recording(tmp_path / "run"))["findings"]
    assert [(f["kind"], f["step"], f["node"]) for f in findings] == [("nonfinite-backward", 2, "CompiledFunctionBackward")]
    # the region returns NaN to layer a's weight and bias (the sqrt sits between a and b; b's gradient stays finite)
    assert findings[0]["parameter"] in {"a.weight", "a.bias"}
    assert set(findings[0]["figures"]["parameters"]) == {"a.weight", "a.bias"}
    # the page names the parameters each gradient went to; the region freed what it saved inside its backward, so
    # the saved tensors are listed by the graph's shapes, their values not read
    from graphviz_core.ui.findings import gradients_frame

    frame = gradients_frame(findings[0])
    assert {"gradient returned to a.weight", "gradient returned to a.bias"} <= set(frame["what"])
    saved = frame[frame["what"].str.startswith("saved tensor")]
    assert len(saved) and set(saved["smallest"]) == {"not read"}


def _compiled_loop(folder, eager: bool):
    """test above's loop, its model compiled (AOTAutograd's regions), recorded with or without the eager replay."""
    torch.manual_seed(0)
    model = _Model()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with graphviz_core.record(folder, model=model, eager=eager):
        for step in range(3):
            out = compiled(torch.randn(6, 8), step == 2)
            torch.nn.functional.cross_entropy(out, torch.randint(0, 3, (6,))).backward()
            opt.step()
            opt.zero_grad()
    torch._dynamo.reset()
    return open_recording(folder)


def test_the_finding_in_a_region_offers_an_eager_replay_that_names_its_op(tmp_path):
    """Compiled, the NaN sits at the region and the finding says how to replay it; recorded again with eager=True
    (torch.compiler.set_stance("force_eager")), the same seeds and data put it at SqrtBackward0 in step 2."""
    compiled = _compiled_loop(tmp_path / "compiled", eager=False)
    [inside] = analyse(compiled)["findings"]
    assert inside["node"] == "CompiledFunctionBackward" and "eager=True" in inside["replay"]
    assert compiled.eager is False
    replayed = _compiled_loop(tmp_path / "eager", eager=True)
    assert replayed.eager is True and replayed.to_dict()["eager"] is True
    [found] = analyse(replayed)["findings"]
    assert (found["kind"], found["step"], found["node"]) == ("nonfinite-backward", 2, "SqrtBackward0")
    assert "replay" not in found
    assert "eager=True" in _shown(inside)  # the page says how to replay it, above the gradients' table
    ops = {d["op"] for g in replayed.steps()[0].backward_graphs for _, d in replayed.graph(g).nodes(data=True)}
    assert "CompiledFunctionBackward" not in ops and "TanhBackward0" in ops  # every op a node of its own


class _SqrtAfter(torch.nn.Module):
    """GELU, plus 0 * sqrt(y - y): the square root of an exact zero, its gradient 0 / (2 * 0) = NaN."""

    def forward(self, x):
        y = torch.nn.functional.gelu(x)
        return y + 0.0 * torch.sqrt(y - y.detach())


def test_a_compiled_presets_step_is_replayed_eagerly_by_itself(monkeypatch):
    """`debug --preset mlp --compile`, the preset's second layer's activation replaced by a faulty one: the compiled
    step's finding sits at its region, and the step replayed eagerly (same weights and batch) names SqrtBackward0 in
    layers.1.act beside it."""
    from graphviz_core.analysis.gradient_flow import analyse_config
    from graphviz_core.config import resolve_config
    from graphviz_core.models import registry

    build = registry.build_model

    def faulty(config):
        model = build(config)
        model.layers[1].act = _SqrtAfter()
        return model

    monkeypatch.setattr(registry, "build_model", faulty)
    findings = analyse_config(resolve_config("mlp", compile=True))["findings"]
    [inside] = [f for f in findings if f["kind"] == "nonfinite-backward"]
    assert inside["node"] == "CompiledFunctionBackward"
    assert inside["eager_replay"]["node"] == "SqrtBackward0" and inside["eager_replay"]["module"] == "layers.1.act"
    assert "; the same step replayed eagerly starts at SqrtBackward0 in layers.1.act" in inside["reason"]
    assert "Inside a compiled region: the same step replayed eagerly starts at SqrtBackward0 in layers.1.act" in \
        _shown(inside)


def _page(finding):
    from graphviz_core.ui.findings import show_gradients

    show_gradients(finding)


def _shown(finding) -> str:
    """The text of the box the Recordings page and the Debug tab show above a chosen finding's gradients."""
    from streamlit.testing.v1 import AppTest

    app = AppTest.from_function(_page, args=(finding,)).run(timeout=30)
    assert not app.exception
    return " ".join(box.value for box in app.info).replace("\\", "")  # the Markdown as written, its escapes dropped


def test_record_eager_flag_runs_the_scripts_compiled_model_eagerly(tmp_path):
    """`graphviz-core record --eager` on an unchanged script that compiles its model: without the flag the recorded
    graph holds the compiled region's node, with it every op is its own node and dynamo compiled no graph."""
    script = tmp_path / "train.py"
    script.write_text("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Sequential(torch.nn.Linear(4, 8), "
                      "torch.nn.Tanh(), torch.nn.Linear(8, 1))\nrun = torch.compile(model, backend='aot_eager')\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor _ in range(2):\n"
                      "    run(torch.randn(3, 4)).pow(2).mean().backward()\n    opt.step()\n    opt.zero_grad()\n"
                      "from torch._dynamo.utils import counters\nprint('graphs', counters['stats']['unique_graphs'])\n")
    for flag, region, graphs in (([], True, "graphs 1"), (["--eager"], False, "graphs 0")):
        folder = tmp_path / f"run{len(flag)}"
        done = docs_zygote.run_cli(["record", *flag, "-o", str(folder), str(script)], timeout=300)
        assert done.returncode == 0, done.stderr
        assert graphs in done.stdout, done.stdout
        recording = open_recording(folder)
        ops = {d["op"] for _, d in recording.graph(recording.steps()[0].backward_graphs[0]).nodes(data=True)}
        assert ("CompiledFunctionBackward" in ops) is region and recording.eager is bool(flag)
