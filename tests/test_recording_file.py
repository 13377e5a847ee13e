"""The recording format (graph/recording.py, docs/recording.md): written as the run goes, so a SIGKILLed run opens
with every completed step and says it is incomplete; a truncated, corrupted or hostile folder gets one sentence from
the reader and from the CLI (exit 2), never a traceback and never code run; `record SCRIPT` runs a script unchanged."""

import json
import os
import pickle
import subprocess
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from graphviz_core.graph.recording import RecordingError, arrow_schemas, open_recording
from tests import docs_zygote

ROOT = Path(__file__).resolve().parents[1]

TRAIN = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kill_at = int(os.environ.get("KILL_AT", "-1"))
    for i in range(int(sys.argv[1])):
        loss = ((model(torch.randn(4, 8)) - 1) ** 2).mean()
        loss.backward()
        if i == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: after its backward, before its optimizer step
        opt.step(); opt.zero_grad()
    print("trained", sys.argv[1:])
""")


def cli(*args, env=None):
    return docs_zygote.run_cli(args, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("script") / "train.py"
    path.write_text(TRAIN)
    return path


@pytest.fixture(scope="module")
def recorded(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("rec") / "run"
    done = cli("record", "--steps", "4", "-o", str(out), str(script), "6", "--its-own-flag")
    assert done.returncode == 0, done.stderr
    assert "trained ['6', '--its-own-flag']" in done.stdout  # the script ran unchanged, with its own arguments
    return out


def test_record_runs_a_script_unchanged_and_recording_prints_the_contract(recorded):
    done = cli("recording", str(recorded), "--format", "json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["format_version"] == 2 and data["complete"] is True and data["ranks"] == [0]  # 2: nodes' min / max
    assert [s["step"] for s in data["steps"]] == [0, 1, 2, 3]  # --steps 4 of the script's 6
    for step in data["steps"]:
        assert {"step", "loss", "skipped", "peak_bytes", "lr", "parameters"} <= set(step)
        assert step["lr"] == 0.1 and step["skipped"] is False and step["peak_bytes"] > 0
        # no model given: the names come from the outermost module the forward called (the Sequential)
        assert set(step["parameters"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        for figures in step["parameters"].values():
            assert set(figures) == {"grad_norm", "weight_norm", "update_norm", "update_ratio"}


def test_a_sigkilled_run_opens_with_every_completed_step(script, tmp_path):
    out = tmp_path / "killed"
    done = cli("record", "-o", str(out), str(script), "10", env={"KILL_AT": "5"})
    assert done.returncode == -9
    recording = open_recording(out)
    assert recording.complete is False
    assert [s.step for s in recording.steps()] == [0, 1, 2, 3, 4]  # step 5 died between its backward and its step
    assert recording.step_graph(4).number_of_nodes() > 0
    shown = cli("recording", str(out))
    assert shown.returncode == 0 and json.loads(shown.stdout)["complete"] is False


def test_a_truncated_stream_keeps_the_steps_before_the_cut(recorded, tmp_path):
    copy = tmp_path / "cut"
    subprocess.run(["cp", "-r", str(recorded), str(copy)], check=True)
    steps_file = copy / "rank-0" / "steps.arrows"
    data = steps_file.read_bytes()
    steps_file.write_bytes(data[: len(data) - 200])  # the end-of-stream marker and part of the last batch gone
    steps = open_recording(copy).steps()
    assert 0 < len(steps) < 4 and [s.step for s in steps] == list(range(len(steps)))


def _hostile(recorded, tmp_path, name):
    copy = tmp_path / name
    subprocess.run(["cp", "-r", str(recorded), str(copy)], check=True)
    return copy


def _steps_with_graph(path: Path, graph: str) -> None:
    schema = arrow_schemas()["steps"]
    row = {f.name: [None] for f in schema}
    row.update(step=[0], skipped=[False], backward_graphs=[[graph]], backward_nodes=[[1]])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.record_batch([pa.array(row[f.name], type=f.type) for f in schema], schema=schema))


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/graphviz_core_pickle_ran",))


HOSTILE = {
    "wrong version": lambda p: (p / "manifest.json").write_text(
        json.dumps({**json.loads((p / "manifest.json").read_text()), "format_version": 99})),
    "a version that is no number": lambda p: (p / "manifest.json").write_text(
        json.dumps({**json.loads((p / "manifest.json").read_text()), "format_version": True})),
    "version 2 columns under a version 1 manifest": lambda p: (p / "manifest.json").write_text(
        json.dumps({**json.loads((p / "manifest.json").read_text()), "format_version": 1})),
    "not a recording": lambda p: (p / "manifest.json").write_text('{"format": "something else"}'),
    "huge manifest": lambda p: (p / "manifest.json").write_text(" " * (2 << 20) + "{}"),
    "a pickle renamed": lambda p: (p / "rank-0" / "steps.arrows").write_bytes(pickle.dumps(_Boom())),
    "random bytes": lambda p: (p / "rank-0" / "steps.arrows").write_bytes(os.urandom(4096)),
    "a path in a field": lambda p: _steps_with_graph(p / "rank-0" / "steps.arrows", "../../../../etc/passwd"),
    "a graph that lies": lambda p: [f.write_text('{"nodes": [{"id": "x", "op": 3}], "links": []}')
                                    for f in (p / "graphs").glob("*.json")],
    "a symlinked stream": lambda p: ((p / "rank-0" / "nodes.arrows").unlink(),
                                     (p / "rank-0" / "nodes.arrows").symlink_to("/etc/passwd")),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_recording_gets_one_sentence(recorded, tmp_path, kind):
    path = _hostile(recorded, tmp_path, kind.replace(" ", "-"))
    HOSTILE[kind](path)
    if os.path.exists("/tmp/graphviz_core_pickle_ran"):
        os.unlink("/tmp/graphviz_core_pickle_ran")
    with pytest.raises(RecordingError) as raised:
        recording = open_recording(path)
        recording.to_dict()
        for step in recording.steps():
            for backward in range(len(step.backward_graphs)):
                recording.step_graph(step.step, backward=backward)
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 300
    done = cli("recording", str(path))
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert not os.path.exists("/tmp/graphviz_core_pickle_ran")  # nothing was unpickled


@pytest.mark.parametrize("args", [["record", "-o", "/tmp/x", "/no/such/script.py"],
                                  ["record", "--steps", "0", "-o", "/tmp/x", "train.py"],
                                  ["record", "/tmp/script.py"], ["recording"], ["recording", "/no/such/run"],
                                  ["recording", "pyproject.toml"]])
def test_bad_input_is_one_line_exit_2(args):
    done = cli(*args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_an_output_that_names_nothing_or_cannot_be_written_or_holds_files_is_refused(script, recorded, tmp_path):
    """Before, `record -o ''` wrote its recording into the current folder (Path('') is '.'), `recording ''` read it,
    `-o ''` printed to stdout; `-o train.py/run` and `-o /proc/version/run` were tracebacks (NotADirectoryError);
    `--steps ٢` recorded 2 steps; a folder of the user's own was written into (its rank-0/debug.jsonl appended to)."""
    own = tmp_path / "mine"
    (own / "rank-0").mkdir(parents=True)
    (own / "rank-0" / "debug.jsonl").write_text("precious\n")
    for args, said in ((["record", "-o", "", str(script)], "-o '' names nothing"),
                       (["record", "-o", f"{script}/run", str(script)], "cannot write the recording in"),
                       (["record", "-o", "/proc/version/run", str(script)], "cannot write the recording in"),
                       (["record", "--steps", "\u0662", "-o", str(tmp_path / "a"), str(script)], "digits 0-9"),
                       (["record", "--nodes-every", "\u0662", "-o", str(tmp_path / "a"), str(script)], "digits 0-9"),
                       (["record", "-o", str(own), str(script)], "is not empty; choose a new or empty folder"),
                       (["recording", ""], "the recording's folder '' names nothing"),
                       (["recording", str(recorded), "-o", ""], "-o '' names nothing"),
                       (["debug", str(recorded), "-o", ""], "-o '' names nothing"),
                       (["debug", ""], "the recording's folder '' names nothing")):
        done = cli(*args)
        assert done.returncode == 2 and done.stdout == "" and said in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert (own / "rank-0" / "debug.jsonl").read_text() == "precious\n"  # untouched
    assert sorted(p.name for p in own.iterdir()) == ["rank-0"] and not (tmp_path / "a").exists()
    assert not (ROOT / "manifest.json").exists()  # cli() runs in the repository's root: nothing written there
    empty = tmp_path / "empty"
    empty.mkdir()
    done = cli("record", "--steps", "1", "-o", str(empty), str(script), "1")
    assert done.returncode == 0 and (empty / "manifest.json").exists(), done.stderr  # an empty folder is new enough


def test_backward_passes_no_step_closed_are_said_not_silently_dropped(tmp_path):
    """A loop that updates its weights by hand (no torch.optim) ran 4 backward passes and recorded none, and record
    said nothing; `recording` then read "the run recorded no step". The CLI says it in one sentence (exit 0: the
    script ran), the Python API warns (UnclosedSteps); a loop that steps records them, and neither says a word."""
    import warnings

    import torch

    import graphviz_core
    from graphviz_core.capture.recorder import UnclosedSteps

    script = tmp_path / "by_hand.py"
    script.write_text("import torch\nm = torch.nn.Linear(3, 1)\nfor _ in range(4):\n"
                      "    m(torch.randn(2, 3)).sum().backward()\n"
                      "    with torch.no_grad():\n        for p in m.parameters():\n"
                      "            p -= 0.1 * p.grad\n            p.grad = None\n")
    done = cli("record", "-o", str(tmp_path / "run"), str(script))
    assert done.returncode == 0 and done.stderr == (
        "graphviz-core: 4 backward passes were not recorded: a step is closed by a torch.optim optimizer's step() (or "
        "by rec.step() in a loop without one; docs/recording.md), and none followed them.\n"), done.stderr
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with graphviz_core.record(tmp_path / "api", model=model):
            for _ in range(2):
                model(torch.randn(2, 3)).sum().backward()
                opt.step()
            model(torch.randn(2, 3)).sum().backward()  # the third, after the last step
    unclosed = [w for w in said if issubclass(w.category, UnclosedSteps)]
    assert [str(w.message)[:63] for w in unclosed] == ["1 backward pass after the last recorded step was not recorded: "]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with graphviz_core.record(tmp_path / "stepped", model=model):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
    assert not [w for w in said if issubclass(w.category, UnclosedSteps)]


def _ddp_rank(rank, world, port, folder, results):
    import torch

    import graphviz_core
    from tests.gloo import gloo_group

    with gloo_group(rank, world, port):
        torch.manual_seed(0)  # the same initial weights on both ranks
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                                                              torch.nn.Linear(8, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(10 + rank)  # each rank its own data
        hand = []
        with graphviz_core.record(folder, model=model.module):
            for _ in range(2):
                model(torch.randn(3, 4)).pow(2).mean().backward()
                hand.append({n: float(torch.linalg.vector_norm(p.grad)) for n, p in model.module.named_parameters()})
                opt.step()
                opt.zero_grad()
        if rank == 0:
            results.put(hand)


def test_two_ddp_ranks_record_into_one_folder_and_open_as_one_run(tmp_path):
    """Two real gloo processes under DistributedDataParallel: each writes rank-<r>/, the folder opens with ranks
    [0, 1], and each rank's gradient norms are DDP's averaged gradient, the same on both ranks (rank 0's taken by
    hand in its loop)."""
    from tests.gloo import spawn_ranks

    hand = spawn_ranks(_ddp_rank, 2, str(tmp_path / "ddp"))
    recording = open_recording(tmp_path / "ddp")
    assert recording.ranks == [0, 1] and recording.complete
    zero, one = recording.steps(0), recording.steps(1)
    assert len(zero) == len(one) == 2
    for a, b, taken in zip(zero, one, hand, strict=True):
        for name, p in a.parameters.items():
            assert abs(p.grad_norm - taken[name]) <= 1e-6 * taken[name]
            assert abs(b.parameters[name].grad_norm - p.grad_norm) <= 1e-6 * p.grad_norm
    assert set(recording.to_dict()["steps_by_rank"]) == {"1"}


def test_a_script_that_fails_keeps_its_traceback_and_exit_code(tmp_path):
    """record runs the script as python would: its own exception's traceback and exit 1, its sys.exit code as is; the
    recording keeps the steps before and says it did not end cleanly."""
    failing = tmp_path / "fails.py"
    failing.write_text(TRAIN.replace('print("trained", sys.argv[1:])', 'raise RuntimeError("the data ran out")'))
    done = cli("record", "-o", str(tmp_path / "failed"), str(failing), "2")
    assert done.returncode == 1
    assert "RuntimeError: the data ran out" in done.stderr and "fails.py" in done.stderr
    recording = open_recording(tmp_path / "failed")
    assert recording.complete is False and len(recording.steps()) == 2
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    assert cli("record", "-o", str(tmp_path / "exited"), str(exits)).returncode == 3
    exits.write_text("import sys\nsys.exit('the data ran out')\n")  # python prints the message, exits 1
    done = cli("record", "-o", str(tmp_path / "said"), str(exits))
    assert done.returncode == 1 and done.stderr.endswith("the data ran out\n"), done.stderr


def _as_version_1(folder) -> None:
    """`folder` rewritten as the recorder wrote it at format version 1: its nodes without `min` and `max`."""
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))
    path = folder / "rank-0" / "nodes.arrows"
    batches = list(pa.ipc.open_stream(pa.memory_map(str(path))))
    schema = arrow_schemas(1)["nodes"]
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(pa.record_batch([batch.column(f.name) for f in schema], schema=schema))


def test_a_version_1_recording_still_opens_without_min_and_max(recorded, tmp_path):
    import shutil

    old = tmp_path / "v1"
    shutil.copytree(recorded, old)
    _as_version_1(old)
    recording = open_recording(old)
    assert recording.version == 1
    graph = recording.step_graph(recording.steps()[0].step)
    assert all(d["min"] is None and d["max"] is None for _, d in graph.nodes(data=True))
    assert any(d["max_abs"] is not None for _, d in graph.nodes(data=True))  # the other figures read as before
    new = open_recording(recorded).step_graph(0)
    assert any(d["min"] is not None for _, d in new.nodes(data=True))
