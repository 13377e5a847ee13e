"""Recording folders someone else made, built to break the reader (graph/recording.py, docs/recording.md): a file
that is no plain file, a graph with a cycle, a parameter without a name, a cut parameters stream, forged figures, rank
folders named twice or hidden among other files, a missing graph under every output format. Each is one sentence
(RecordingError, exit 2 from the CLI), never a traceback, a hang, an unbounded read or figures shown as if true."""

import json
import os
import shutil
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from graphviz_core.export.recording_export import to_chrome_trace, to_tensorboard
from graphviz_core.graph import recording as recording_module
from graphviz_core.graph.recording import MAX_RANKS, RecordingError, open_recording
from tests import docs_zygote
from tests.recorded_loops import mlp_sgd
from tests.test_recording_file import _as_version_1

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4  # recorded steps of tests/recorded_loops.py's MLP with SGD


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "run"
    mlp_sgd(path, steps=STEPS)
    return path


@pytest.fixture
def run(recorded, tmp_path):
    """A copy of the clean recording, for the test to damage."""
    copy = tmp_path / "run"
    shutil.copytree(recorded, copy)
    return copy


def _graph_file(path: Path) -> Path:
    (graph,) = (path / "graphs").glob("*.json")  # one MLP, one graph
    return graph


def _read_everything(path: Path) -> None:
    """What `recording` (json and chrome-trace) and `debug` read: every step, its node figures and its graphs."""
    recording = open_recording(path)
    recording.to_dict()
    to_chrome_trace(recording)
    for rank in recording.ranks:
        for step in recording.steps(rank):
            for backward in range(len(step.backward_graphs)):
                recording.step_graph(step.step, rank, backward)


def _one_sentence(path: Path) -> str:
    with pytest.raises(RecordingError) as raised:
        _read_everything(path)
    message = str(raised.value)
    assert "\n" not in message and len(message) < 300, message
    return message


def _rewrite(path: Path, stream: str, change) -> None:
    """rank-0/<stream>.arrows written again, `change(index, columns)` applied to each batch's columns (a dict of
    lists, batch `index` being step `index`'s)."""
    file = path / "rank-0" / f"{stream}.arrows"
    reader = pa.ipc.open_stream(file.read_bytes())
    schema, batches = reader.schema, list(reader)
    with pa.OSFile(str(file), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for index, batch in enumerate(batches):
            columns = {name: batch.column(name).to_pylist() for name in schema.names}
            change(index, columns)
            writer.write_batch(pa.record_batch([pa.array(columns[f.name], type=f.type) for f in schema],
                                               schema=schema))


def _set(column: str, value, at: int = 0, row: int = 0):
    """A change for _rewrite: batch `at`'s row `row` of `column` set to `value`."""
    def change(index, columns):
        if index == at:
            columns[column][row] = value
    return change


# ---- 1. every JSON file is read only from a plain file, and never more than its limit ------------------------------

@pytest.mark.parametrize("where", ["manifest.json", "rank-0/status.json", "graph"])
def test_a_json_file_that_is_a_device_is_refused_not_read_without_end(run, where):
    # /dev/zero says its size is 0 and never ends: read to its end it fills memory (a MemoryError traceback)
    target = _graph_file(run) if where == "graph" else run / where
    target.unlink()
    target.symlink_to("/dev/zero")
    assert "is not a plain file" in _one_sentence(run)


@pytest.mark.parametrize("where", ["manifest.json", "rank-0/status.json", "graph"])
def test_a_json_file_that_is_a_fifo_is_refused_without_waiting(run, where):
    target = _graph_file(run) if where == "graph" else run / where
    target.unlink()
    os.mkfifo(target)
    outcome = []

    def read():
        try:
            _read_everything(run)
            outcome.append("read")
        except RecordingError as exc:
            outcome.append(str(exc))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():  # it waits for a writer: open one, so the thread ends, and fail
        os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=30)
        pytest.fail(f"reading a recording whose {where} is a FIFO waited for a writer")
    assert len(outcome) == 1 and "is not a plain file" in outcome[0], outcome


def test_a_json_file_larger_than_its_limit_is_refused_whatever_its_size_says(run, monkeypatch):
    # the manifest's limit lowered to 100 bytes: the recorder's manifest (its keys, a date, torch's version) is longer
    monkeypatch.setattr(recording_module, "MAX_JSON_BYTES", 100)
    assert len((run / "manifest.json").read_bytes()) > 100
    assert "more than the 100 bytes" in _one_sentence(run)


def test_a_stream_that_is_a_symlink_to_nothing_is_refused_not_read_as_empty(run):
    (run / "rank-0" / "steps.arrows").unlink()
    (run / "rank-0" / "steps.arrows").symlink_to(run / "elsewhere.arrows")  # no such file
    assert "is not a plain file" in _one_sentence(run)  # before: read as a stream of no step


# ---- 2. an autograd graph has no cycle ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["back to the first node", "to itself"])
def test_a_graph_with_a_cycle_is_refused_when_read(run, kind):
    graph = _graph_file(run)
    data = json.loads(graph.read_text())
    first, last = data["nodes"][0]["id"], data["nodes"][-1]["id"]  # the loss's node, a leaf's AccumulateGrad
    data["links"].append({"source": last if kind == "back to the first node" else first, "target": first})
    graph.write_text(json.dumps(data))
    assert "has a cycle" in _one_sentence(run)  # before: networkx's NetworkXUnfeasible from the chrome trace's sort


# ---- 3. a value the format needs is never null -----------------------------------------------------------------

@pytest.mark.parametrize("name", [None, ""])
def test_a_parameter_without_a_name_is_refused(run, name):
    _rewrite(run, "parameters", _set("name", name, at=1))
    assert "without a name" in _one_sentence(run)  # before: shown as a parameter named null, or ""


def test_a_step_without_a_step_number_is_refused(run):
    _rewrite(run, "steps", _set("step", None, at=2))
    assert "has step None after step 1" in _one_sentence(run)


def test_a_step_without_skipped_is_refused(run):
    _rewrite(run, "steps", _set("skipped", None, at=0))
    assert "has no `skipped`" in _one_sentence(run)  # before: read as False


# ---- 4. a cut parameters stream keeps the steps before the cut --------------------------------------------------

def test_a_cut_parameters_stream_keeps_only_the_steps_whose_parameters_are_there(run):
    # the stream written again, its third batch (step 2's) cut in half and nothing after it: steps 0 and 1 have their
    # parameter rows, steps 2 and 3 none, though steps.arrows holds all four rows
    file = run / "rank-0" / "parameters.arrows"
    batches = list(pa.ipc.open_stream(file.read_bytes()))
    sink = pa.BufferOutputStream()
    writer = pa.ipc.new_stream(sink, batches[0].schema)
    ends = []
    for batch in batches[:3]:
        writer.write_batch(batch)
        ends.append(sink.tell())
    writer.close()
    file.write_bytes(sink.getvalue().to_pybytes()[: (ends[1] + ends[2]) // 2])
    recording = open_recording(run)
    steps = recording.steps()
    assert [s.step for s in steps] == [0, 1]  # before: [0, 1, 2, 3], steps 2 and 3 with `parameters: {}`
    assert all(len(s.parameters) == 4 for s in steps)  # Linear(8, 16) and Linear(16, 3): two weights, two biases
    assert [s["step"] for s in recording.to_dict()["steps"]] == [0, 1]


# ---- 5. figures that cannot be ----------------------------------------------------------------------------------

FORGED = {
    # stream, column, value, at (the batch: the step), and what the sentence names
    "a node's negative non-finite count": ("nodes", "nonfinite", -7, 1, "negative nonfinite"),
    "a node's negative gradient norm": ("nodes", "grad_norm", -1.0, 0, "negative grad_norm"),
    "a step's negative gradient norm": ("steps", "grad_norm", -1.0, 1, "negative grad_norm"),
    "a parameter's negative gradient norm": ("parameters", "grad_norm", -1.0, 2, "negative grad_norm"),
    "a parameter's negative weight norm": ("parameters", "weight_norm", -0.5, 2, "negative weight_norm"),
    "a negative first step": ("steps", "step", -1, 0, "has step -1 first"),
    "a step twice": ("steps", "step", 0, 1, "has step 0 after step 0"),
}


@pytest.mark.parametrize("kind", sorted(FORGED))
def test_a_forged_figure_is_refused_naming_its_file_and_field(run, kind):
    stream, column, value, at, said = FORGED[kind]
    _rewrite(run, stream, _set(column, value, at=at))
    message = _one_sentence(run)
    assert said in message and f"{stream}.arrows" in message, message


def test_a_parameter_row_of_another_step_is_refused(run):
    _rewrite(run, "parameters", _set("step", 3, at=1))  # step 1's batch with a row that says step 3
    assert "holds a row of step 3 among step 1's" in _one_sentence(run)


def test_a_name_twice_in_a_step_keeps_both_parameters(run, tmp_path):
    """Two loose top-level modules recorded without model= are each named from their own root: an Embedding and a
    Linear both have "weight". Both are kept, the second as "weight#2" (before: one row silently replaced the other;
    then, for a while, the recording was refused as damaged)."""
    import torch

    import graphviz_core

    emb, fc = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2)
    opt = torch.optim.SGD([*emb.parameters(), *fc.parameters()], lr=0.1)
    with graphviz_core.record(tmp_path / "loose"):
        fc(emb(torch.tensor([1, 2]))).sum().backward()
        opt.step()
    (step,) = open_recording(tmp_path / "loose").steps()
    assert sorted(step.parameters) == ["bias", "weight", "weight#2"]  # Embedding: weight; Linear: weight, bias
    # a negative peak: a model over several GPUs, recorded before the recorder left out only the peak's device's own
    # copies; not known, never damage
    _rewrite(run, "steps", _set("peak_bytes", -5, at=1))
    assert open_recording(run).steps()[1].peak_bytes is None


def test_a_graph_with_two_nodes_of_one_id_is_refused(run):
    graph = _graph_file(run)
    data = json.loads(graph.read_text())
    data["nodes"][1]["id"] = data["nodes"][0]["id"]
    data["links"] = [link for link in data["links"] if link["source"] in {n["id"] for n in data["nodes"]}
                     and link["target"] in {n["id"] for n in data["nodes"]}]
    graph.write_text(json.dumps(data))
    with pytest.raises(RecordingError, match="two nodes with the id"):
        open_recording(run).graph(graph.stem)  # before: one node kept, a graph of one node fewer than the file's


def test_a_graph_of_fewer_nodes_than_its_rows_is_refused_by_every_output(run):
    graph = _graph_file(run)
    data = json.loads(graph.read_text())
    gone = data["nodes"].pop()["id"]
    data["links"] = [link for link in data["links"] if gone not in (link["source"], link["target"])]
    graph.write_text(json.dumps(data))
    count = len(data["nodes"])
    with pytest.raises(RecordingError, match=f"node rows for graph {graph.stem}, which has {count} nodes"):
        open_recording(run).to_dict()  # before: printed, a graph of `count` nodes under steps of count + 1 rows


def test_a_status_that_claims_fewer_steps_than_the_streams_hold_is_refused(run):
    # the recorder writes status.json after every step: it can claim no fewer steps than steps.arrows holds
    (run / "rank-0" / "status.json").write_text(json.dumps({"complete": True, "steps": STEPS - 1}))
    assert f"says the run recorded {STEPS - 1} steps, but steps.arrows holds {STEPS}" in _one_sentence(run)


@pytest.mark.parametrize("status", [{"complete": "yes", "steps": STEPS}, {"complete": True, "steps": -1},
                                    {"complete": True}])
def test_a_status_of_the_wrong_shape_is_refused(run, status):
    (run / "rank-0" / "status.json").write_text(json.dumps(status))
    assert "does not hold a yes-or-no `complete`" in _one_sentence(run)


# ---- 6. a rank folder is named rank-<n>, once per rank -----------------------------------------------------------

def test_a_rank_folder_with_a_leading_zero_is_not_a_rank(run):
    (run / "rank-0").rename(run / "rank-00")
    # before: rank-00 was read as rank 0, whose files were then looked for in rank-0/: no step at all
    assert "holds no rank-<n> folder" in _one_sentence(run)


def test_rank_0_and_rank_00_are_one_rank(run):
    shutil.copytree(run / "rank-0", run / "rank-00")
    recording = open_recording(run)
    assert recording.ranks == [0]  # before: [0, 0], every step shown twice
    assert [s["step"] for s in recording.to_dict()["steps"]] == list(range(STEPS))


# ---- 7. the recording folder is looked through whole, and within bounds --------------------------------------------

def test_rank_folders_are_found_among_thousands_of_other_files(run):
    # 8,300 names sorted before "rank-0": more than the MAX_RANKS * 2 + 16 = 8,208 first names the reader looked at
    for index in range(8300):
        (run / f"checkpoint-{index:05d}.txt").touch()
    assert open_recording(run).ranks == [0]  # before: "holds no rank-<n> folder"


def test_more_rank_folders_than_the_reader_opens_is_one_sentence(run):
    for rank in range(1, MAX_RANKS + 1):  # with rank-0: MAX_RANKS + 1 rank folders
        (run / f"rank-{rank}").mkdir()
    with pytest.raises(RecordingError, match=f"more than {MAX_RANKS:,} rank folders"):
        open_recording(run)  # before: the first 4,096 in text order kept, without a word


def test_a_folder_of_too_many_entries_is_refused_not_looked_through_forever(run, monkeypatch):
    # the bound lowered to 100 entries (the real one is 1,000,000: too many files to make in a test); 150 files beside
    # the manifest, graphs and rank-0
    monkeypatch.setattr(recording_module, "MAX_FOLDER_ENTRIES", 100)
    for index in range(150):
        (run / f"checkpoint-{index:05d}.txt").touch()
    with pytest.raises(RecordingError, match="more than 100 entries"):
        open_recording(run)


# ---- 8. a missing graph is refused by every output format ------------------------------------------------------

def test_tensorboard_refuses_a_step_whose_graph_file_is_missing(run, tmp_path):
    _graph_file(run).unlink()
    with pytest.raises(RecordingError, match="is missing"):
        to_tensorboard(open_recording(run), tmp_path / "tb")  # before: event files written, as if nothing lacked
    assert not (tmp_path / "tb").exists()  # refused before any event file is written
    done = docs_zygote.run_cli(["recording", str(run), "--format", "tensorboard", "-o", str(tmp_path / "tb")],
                               timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1 and "is missing" in done.stderr


# ---- 9. the recording's own format version --------------------------------------------------------------------------

def test_recording_prints_the_recordings_own_format_version(run):
    _as_version_1(run)
    assert open_recording(run).to_dict()["format_version"] == 1  # before: 2, the version the recorder writes now


# ---- the CLI: one sentence, exit 2 -------------------------------------------------------------------------------

def _graph_cycle(path: Path) -> None:
    graph = _graph_file(path)
    data = json.loads(graph.read_text())
    data["links"].append({"source": data["nodes"][-1]["id"], "target": data["nodes"][0]["id"]})
    graph.write_text(json.dumps(data))


CLI = {
    "recording, a manifest that is /dev/zero": (["recording"], lambda p: ((p / "manifest.json").unlink(),
                                                                          (p / "manifest.json").symlink_to("/dev/zero"))),
    "recording, a status that is a FIFO": (["recording"], lambda p: ((p / "rank-0" / "status.json").unlink(),
                                                                     os.mkfifo(p / "rank-0" / "status.json"))),
    "chrome-trace, a graph with a cycle": (["recording", "--format", "chrome-trace"], _graph_cycle),
    "debug, a graph with a cycle": (["debug"], _graph_cycle),
    "debug, a parameter without a name": (["debug"], lambda p: _rewrite(p, "parameters", _set("name", None))),
    # each said its own way before: Python's "Out of range float values are not JSON compliant: nan", its advice to
    # call sys.set_int_max_str_digits(), "holds a NoneType"
    "recording, a step's scale that is NaN": (["recording"], lambda p: _rewrite(p, "steps", _set("scale", float("nan")))),
    "recording, a 5,000-digit number in the manifest": (["recording"], lambda p: (p / "manifest.json").write_text(
        (p / "manifest.json").read_text()[:-1] + ', "n": ' + "9" * 5000 + "}")),
    "recording, a manifest that is null": (["recording"], lambda p: (p / "manifest.json").write_text("null")),
}
SAID = {"recording, a step's scale that is NaN": "holds a NaN or infinity where a figure should be a number",
        "recording, a 5,000-digit number in the manifest": "holds a number longer than any a recording manifest has",
        "recording, a manifest that is null": "holds null, not the object a recording manifest is"}


@pytest.mark.parametrize("kind", sorted(CLI))
def test_the_cli_says_one_sentence_and_exits_2(run, kind):
    command, damage = CLI[kind]
    damage(run)
    done = docs_zygote.run_cli([command[0], str(run), *command[1:]], timeout=120, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stderr[-2000:])
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert SAID.get(kind, "") in done.stderr, done.stderr
