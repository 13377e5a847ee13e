"""record(..., nodes_every=N): the per-node figures on steps 0, N, 2N, ... only, the per-step and per-parameter figures
on every step (docs/recording.md: on a GPU the per-node work costs most)."""

import math

import pytest
import torch

import graphviz_core
from graphviz_core.analysis.gradient_flow import analyse
from graphviz_core.graph.recording import open_recording
from tests import docs_zygote


def _loop(folder, nodes_every, fault_at=None, steps=7):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    norms = []
    with graphviz_core.record(folder, model=model, nodes_every=nodes_every):
        for step in range(steps):
            hidden = model[1](model[0](torch.randn(6, 8)))
            if step == fault_at:
                hidden = hidden + 0.0 * torch.sqrt(hidden - hidden.detach())  # NaN in backward, started at the sqrt
            torch.nn.functional.cross_entropy(model[2](hidden), torch.randint(0, 3, (6,))).backward()
            norms.append({n: float(torch.linalg.vector_norm(p.grad)) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
    return open_recording(folder), norms


def test_every_third_step_has_node_figures_and_every_step_its_parameters(tmp_path):
    recording, norms = _loop(tmp_path / "run", 3)
    steps = recording.steps()
    assert [s.step for s in steps if s.backward_graphs] == [0, 3, 6]  # 0, N, 2N with N = 3, of steps 0..6
    for step, hand in zip(steps, norms, strict=True):
        for name, p in step.parameters.items():  # every step: the gradient norms, as torch has them
            assert math.isclose(p.grad_norm, hand[name], rel_tol=1e-6)
    every, _ = _loop(tmp_path / "every", 1)
    assert all(s.backward_graphs for s in every.steps())  # the default: every step


def test_a_nan_on_a_sampled_step_is_found_and_the_others_are_quiet(tmp_path):
    recording, _ = _loop(tmp_path / "run", 3, fault_at=6)
    found = [(f["kind"], f["step"], f.get("node")) for f in analyse(recording)["findings"]]
    assert found == [("nonfinite-backward", 6, "SqrtBackward0")]


@pytest.mark.parametrize("given", [0, -2, 1.5, True, "3"])
def test_a_bad_nodes_every_is_a_sentence(tmp_path, given):
    with pytest.raises(ValueError, match="how often a step gets per-node figures"):
        with graphviz_core.record(tmp_path / "x", nodes_every=given):
            pass


def test_the_cli_flag_and_its_refusals(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nm = torch.nn.Linear(3, 1)\no = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for _ in range(4):\n    m(torch.randn(2, 3)).sum().backward(); o.step(); o.zero_grad()\n")

    def cli(*args):
        return docs_zygote.run_cli(["record", *args], timeout=300)

    done = cli("--nodes-every", "2", "-o", str(tmp_path / "run"), str(script))
    assert done.returncode == 0, done.stderr
    assert [s.step for s in open_recording(tmp_path / "run").steps() if s.backward_graphs] == [0, 2]
    for bad in (["--nodes-every", "0"], ["--nodes-every", "2", "--parameters-only"]):
        refused = cli(*bad, "-o", str(tmp_path / "bad"), str(script))
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
