"""Gradient-flow debugging of a torch.compile'd model (issue 36 item 5): a NaN started inside a compiled region is
placed at that region's node (CompiledFunctionBackward: the compiled ops are one node of the recorded graph) and at
the parameters the region sent it to."""

import torch

import graphviz_core
from graphviz_core.analysis.gradient_flow import analyse
from graphviz_core.graph.recording import open_recording


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
