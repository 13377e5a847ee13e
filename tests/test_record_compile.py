"""Recording a loop over a torch.compile'd model (issue 35 item 9): every parameter recorded, the compiled region a node
of the recorded graph, and no graph break added by the recorder (dynamo's own counters, with and without it).

Before: the recorder's wrapped torch.autograd.grad was entered by AOTAutograd's own tracing of the backward (fake
tensors, while compiling) and read a fake storage ("Attempted to access the data pointer on an invalid python
storage"); its module hooks called autograd's sequence counter inside traced code, a graph break per module call."""

from __future__ import annotations

import contextlib

import torch
from torch._dynamo.utils import counters

import graphviz_core
from graphviz_core.graph.recording import open_recording


def loop(path=None, steps: int = 3, check_forward: bool = False):
    """A 2-layer MLP compiled, SGD, `steps` steps; the gradient norms taken by hand, dynamo's graph-break count."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    norms = []
    with graphviz_core.record(path, model=model, check_forward=check_forward) if path else contextlib.nullcontext():
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(compiled(x), y)
            loss.backward()
            norms.append({n: float(torch.linalg.vector_norm(p.grad)) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
    return norms, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def test_a_compiled_model_records_every_parameter_and_adds_no_graph_break(tmp_path):
    import warnings

    _, breaks_bare, graphs_bare = loop()
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        by_hand, breaks, graphs = loop(tmp_path / "run")
    # torch's warning that the compiled module fires global hooks once more is the recorder's to expect, not the
    # user's to read; the filter that silences it goes with the recording
    assert not [w for w in caught if "global hooks on modules" in str(w.message)], [str(w.message) for w in caught]
    assert warnings.filters == before
    assert (breaks, graphs) == (breaks_bare, graphs_bare)  # the recorder changes nothing dynamo compiles
    # nor does its forward check (a torch function mode dynamo traces into: it steps aside while dynamo compiles; its
    # .item() reads had broken the graph at every op)
    assert loop(tmp_path / "checked", check_forward=True)[1:] == (breaks_bare, graphs_bare)
    recording = open_recording(tmp_path / "run")
    steps = recording.steps()
    assert [s.step for s in steps] == [0, 1, 2] and recording.complete
    for step, want in zip(steps, by_hand, strict=True):
        assert set(step.parameters) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        for name, figure in step.parameters.items():
            assert abs(figure.grad_norm - want[name]) <= 1e-5 * want[name], (step.step, name)
    ops = [data["op"] for _, data in recording.step_graph(0).nodes(data=True)]
    assert any(op.startswith("CompiledFunction") for op in ops), ops  # the compiled region, one node
    assert ops.count("AccumulateGrad") == 4  # every parameter's gradient leaves the region into .grad
