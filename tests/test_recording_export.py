"""A recording exported where people already look (export/recording_export.py): TensorBoard event files read back
with TensorBoard's own reader, and a Chrome trace (Perfetto / chrome://tracing) of per-node backward times; both
from the CLI's `recording PATH --format ...`, bad input one sentence and exit 2."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

import graphviz_core
from graphviz_core.export.recording_export import run_order, to_chrome_trace, to_tensorboard
from graphviz_core.graph.recording import open_recording
from tests import docs_zygote

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def amp_run(tmp_path_factory):
    """Four float16-autocast steps with a GradScaler, step 2's loss made infinite (the scaler skips it)."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    path = tmp_path_factory.mktemp("export") / "amp"
    with graphviz_core.record(path, model=model):
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(5, 8)).float().pow(2).mean()
            if step == 2:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return path


def test_tensorboard_event_files_read_back_with_tensorboards_reader(amp_run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recording = open_recording(amp_run)
    steps = recording.steps()
    written = to_tensorboard(recording, tmp_path / "tb")
    assert len(written) == 1
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    # the loss of every step with a finite one (step 2's is infinite: the recording holds null, nothing is written)
    losses = {e.step: e.value for e in events.Scalars("loss")}
    assert sorted(losses) == [0, 1, 3]
    for s in steps:
        if s.loss is not None:
            assert math.isclose(losses[s.step], s.loss, rel_tol=1e-6)  # TensorBoard stores float32
    assert [e.value for e in events.Scalars("skipped")] == [0.0, 0.0, 1.0, 0.0]
    # the skipped step: its four parameter gradients are not finite, the scalar counts them
    nonfinite = {e.step: e.value for e in events.Scalars("nonfinite/parameter_gradients")}
    assert nonfinite[1] == 0 and nonfinite[2] == sum(not math.isfinite(p.grad_norm) for p in steps[2].parameters.values())
    assert nonfinite[2] > 0
    assert "grad_norm/2.weight" in tags["scalars"] and "update_ratio/0.weight" in tags["scalars"]
    # one histogram value per parameter tensor: 4 (two Linear layers, weight and bias each); its sum and extremes are
    # the recorded gradient norms'
    histograms = {e.step: e.histogram_value for e in events.Histograms("parameters/grad_norm")}
    grads = [p.grad_norm for p in steps[1].parameters.values()]
    assert histograms[1].num == 4
    assert math.isclose(histograms[1].sum, sum(grads), rel_tol=1e-9)
    assert math.isclose(histograms[1].min, min(grads)) and math.isclose(histograms[1].max, max(grads))
    assert 2 not in histograms  # no finite gradient norm at the skipped step: no histogram, the scalar says why
    nodes = {e.step: e.histogram_value for e in events.Histograms("nodes/time_s")}
    ran = [v for v in recording.node_figures()[0][0].column("time_s").to_pylist() if v is not None]
    assert nodes[0].num == len(ran) and math.isclose(nodes[0].sum, sum(ran), rel_tol=1e-6)


def test_chrome_trace_holds_every_node_that_ran_in_an_order_autograd_could_run(amp_run):
    recording = open_recording(amp_run)
    trace = to_chrome_trace(recording)
    json.dumps(trace, allow_nan=False)  # no NaN: non-finite figures are written as their names
    events = trace["traceEvents"]
    steps = [e for e in events if e.get("cat") == "step"]
    assert [e["name"] for e in steps] == ["step 0", "step 1", "step 2", "step 3"]
    # steps end to end: each starts where the one before ended
    for before, after in zip(steps, steps[1:], strict=False):
        assert math.isclose(after["ts"], before["ts"] + before["dur"], abs_tol=0.01)
    nodes = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    for index, step in enumerate(recording.steps()):
        mine = [e for e in nodes if e["args"]["step"] == step.step]
        batch = recording.node_figures()[index][0]
        times = [v for v in batch.column("time_s").to_pylist() if v is not None]
        assert len(mine) == len(times)  # one event per node that ran
        assert math.isclose(sum(e["dur"] for e in mine), sum(times) * 1e6, rel_tol=1e-4)
        # laid out end to end, each node after every node that sends it its gradient
        ends = {e["args"]["node"]: e["ts"] + e["dur"] for e in mine}
        start = {e["args"]["node"]: e["ts"] for e in mine}
        graph = recording.graph(step.backward_graphs[0])
        for u, v in graph.edges:
            if u in ends and v in start:
                assert start[v] >= ends[u] - 0.01
    skipped = [e for e in nodes if e["args"]["step"] == 2]
    assert any(e["args"]["nonfinite"] for e in skipped)
    assert any(isinstance(e["args"]["grad_norm"], str) for e in skipped)  # "inf" or "nan", never dropped
    assert "laid out, not measured" in trace["otherData"]["note"]


def test_run_order_puts_each_node_after_its_senders():
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_nodes_from(["loss", "b", "a", "leaf"])  # graph order: b before a
    graph.add_edges_from([("loss", "a"), ("loss", "b"), ("a", "b"), ("b", "leaf")])
    # b needs a's gradient first, though b comes first in the graph's order
    assert run_order(graph) == ["loss", "a", "b", "leaf"]


def cli(*args):
    return docs_zygote.run_cli(args, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_cli_formats_and_refusals(amp_run, tmp_path):
    done = cli("recording", str(amp_run), "--format", "chrome-trace", "-o", str(tmp_path / "trace.json"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    done = cli("recording", str(amp_run), "--format", "tensorboard", "-o", str(tmp_path / "tb"))
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    done = cli("recording", str(amp_run), "--format", "tensorboard")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "-o FOLDER" in done.stderr
    (tmp_path / "afile").write_text("x")
    done = cli("recording", str(amp_run), "--format", "tensorboard", "-o", str(tmp_path / "afile"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "is a file" in done.stderr
    done = cli("recording", str(tmp_path / "nowhere"), "--format", "chrome-trace")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "does not exist" in done.stderr
