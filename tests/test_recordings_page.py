"""The Recordings page (pages/recordings.py, ui/recordings_view.py) without a browser: its figures per layer (NaN and
inf kept), the served folder's confinement (no `..`, no symlink out), the upload's limits, and the page under AppTest
with a served folder holding real recordings and a broken one."""

import io
import json
import math
import os
import shutil
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from graphviz_core.analysis.gradient_flow import parameter_layer as layer_of
from graphviz_core.graph.recording import RecordingError, open_recording
from graphviz_core.ui.recordings_view import (
    RECORDINGS_ENV,
    contained,
    heatmap,
    layer_table,
    listed_recordings,
    log_ticks,
    unpack,
)
from tests.conftest import plain
from tests.recorded_loops import float16_grad_scaler, mlp_sgd

PAGE = str(Path(__file__).resolve().parents[1] / "pages" / "recordings.py")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    mlp_sgd(root / "mlp-sgd", steps=3)
    float16_grad_scaler(root / "float16-grad-scaler")
    broken = root / "wrong-version"
    shutil.copytree(root / "mlp-sgd", broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    (broken / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    return root


def test_layers_and_their_figures_keep_nan_and_inf(served):
    assert layer_of("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert layer_of("transformer.wte.weight") == "transformer.wte"
    assert layer_of("0.bias") == "0" and layer_of("weight") == "(model)"
    steps = open_recording(served / "float16-grad-scaler").steps()
    table = layer_table(steps, "grad_norm")
    # two Linear layers ("0", "2") at each of 5 steps: 10 cells, none dropped
    assert len(table) == 10
    first = steps[0].parameters
    # a layer's gradient norm is its whole gradient's: the root of its parameters' squared norms
    expected = math.sqrt(first["0.weight"].grad_norm ** 2 + first["0.bias"].grad_norm ** 2)
    cell = table[(table.step == 0) & (table.layer == "0")].iloc[0]
    assert cell.kind == "finite" and math.isclose(cell.value, expected, rel_tol=1e-12)
    skipped = table[table.step == 2]
    assert len(skipped) == 2 and set(skipped.kind) <= {"NaN", "+inf"}  # the overflow step: drawn, in its own colour
    ratios = layer_table(steps, "update_ratio")
    # the scaler skipped the step: no update, so no ratio, an empty cell (it read "zero", grey, where
    # docs/debugging.md says a skipped step has no update and no ratio); the steps around it have theirs
    assert ratios[ratios.step == 2].empty and len(ratios[ratios.step == 1]) == 2
    from graphviz_core.analysis.gradient_flow import update_ratios

    assert update_ratios(steps[2]) == {} and set(update_ratios(steps[1])) == {"0", "2"}  # debug's steps[].update_ratio


def test_the_log_colour_scale_is_labelled_at_its_ends_and_between():
    # 0.012 to 0.094, within one decade: ratio 0.094 / 0.012 = 7.83, quarter steps of its log 7.83 ** (1/4) = 1.673:
    # 0.012 x 1.673 = 0.0201 -> 0.02, x 1.673**2 = 0.0336 -> 0.034, x 1.673**3 = 0.0562 -> 0.056 (two digits)
    assert log_ticks(0.012, 0.094) == [0.012, 0.02, 0.034, 0.056, 0.094]
    # 2 to 2000: quarter steps of 1000 ** (1/4) = 5.623: 11.2 -> 11, 63.2 -> 63, 355.7 -> 360
    assert log_ticks(2.0, 2000.0) == [2.0, 11.0, 63.0, 360.0, 2000.0]
    assert log_ticks(1.0, 1.004) == [1.0, 1.004]  # 1.0014, 1.002, 1.003 round to 1.0: only the ends
    assert log_ticks(0.005, 0.005) == [0.005]  # one value: one label
    table = pd.DataFrame([{"step": 0, "layer": "0", "kind": "finite", "order": 0, "value": 0.012, "shown": "0.012"},
                          {"step": 1, "layer": "0", "kind": "finite", "order": 0, "value": 0.094, "shown": "0.094"},
                          {"step": 2, "layer": "0", "kind": "NaN", "order": 0, "value": None, "shown": "NaN"}])
    layers = heatmap(table, "gradient norm").to_dict()["layer"]
    finite, special = layers[0]["encoding"]["color"], layers[1]["encoding"]["color"]
    assert finite["scale"]["type"] == "log" and finite["legend"]["values"] == [0.012, 0.02, 0.034, 0.056, 0.094]
    # the legend of colours off the scale names the NaN drawn, not +inf, zero and no gradient, which are not
    assert special["scale"]["domain"] == ["NaN"] and special["scale"]["range"] == ["#e6007e"]
    clean = heatmap(table[table["kind"] == "finite"], "gradient norm").to_dict()["layer"][1]["encoding"]["color"]
    assert clean["legend"] is None  # nothing off the scale: no legend for it


def test_the_served_folder_lists_and_opens_only_its_own_recordings(served, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(served, root)
    outside = tmp_path / "outside"
    shutil.copytree(served / "mlp-sgd", outside)
    os.symlink(outside, root / "link-out")  # a symlink to a recording elsewhere: never listed
    assert listed_recordings(root) == ["float16-grad-scaler", "mlp-sgd", "wrong-version"]
    with pytest.raises(RecordingError, match="is a symlink"):
        contained(root / "link-out", root)
    with pytest.raises(RecordingError, match="outside the recordings folder"):
        contained(root / ".." / "outside", root)
    os.symlink(outside / "manifest.json", root / "mlp-sgd" / "graphs" / "leak.json")  # a symlink inside one
    with pytest.raises(RecordingError, match="holds a symlink"):
        contained(root / "mlp-sgd", root)
    assert contained(root / "float16-grad-scaler", root) == Path(os.path.realpath(root / "float16-grad-scaler"))


def _zip(entries: dict) -> bytes:
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w") as archive:
        for name, body in entries.items():
            archive.writestr(name, body)
    return data.getvalue()


def test_an_upload_is_unpacked_within_its_limits(served, tmp_path):
    recording = served / "mlp-sgd"
    files = {f"run/{p.relative_to(recording)}": p.read_bytes() for p in recording.rglob("*") if p.is_file()}
    opened = unpack(_zip(files), tmp_path / "a")
    assert open_recording(opened).steps()[2].step == 2
    # zipped from inside the folder (cd run && zip -r ../run.zip .): the manifest at the top of the .zip opens too
    flat = unpack(_zip({name.removeprefix("run/"): body for name, body in files.items()}), tmp_path / "flat")
    assert flat == tmp_path / "flat" and contained(flat, tmp_path / "flat", itself=True) == flat.resolve()
    with pytest.raises(RecordingError, match="outside the recordings folder"):
        contained(flat, tmp_path / "flat")  # a served folder's own recordings are below it, never the folder itself
    with pytest.raises(RecordingError, match=r"holds 2 recordings \(a, b\); upload one recording's folder"):
        unpack(_zip({f"{top}/{name.removeprefix('run/')}": body for top in "ab" for name, body in files.items()}),
               tmp_path / "two")
    with pytest.raises(RecordingError, match=r"holds 2 recordings \(its top, b\)"):  # was "(., b)"
        unpack(_zip({**{name.removeprefix("run/"): body for name, body in files.items()},
                     **{f"b/{name.removeprefix('run/')}": body for name, body in files.items()}}), tmp_path / "top")
    for bad, said in ((_zip({"../evil/manifest.json": "{}"}), "outside its folder"),
                      (_zip({"/etc/manifest.json": "{}"}), "outside its folder"),
                      (b"not a zip at all", "not a .zip"),
                      (_zip({"run/readme.txt": "x"}), "no manifest.json")):
        with pytest.raises(RecordingError, match=said):
            unpack(bad, tmp_path / "b")
    link = zipfile.ZipInfo("run/manifest.json")
    link.external_attr = (0o120777 << 16)
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w") as archive:
        archive.writestr(link, "/etc/passwd")
    with pytest.raises(RecordingError, match="symlink"):
        unpack(data.getvalue(), tmp_path / "c")
    assert not (tmp_path / "evil").exists()
    # one byte over 200 MiB = 200 x 2**20 = 209,715,200 B; said in bytes, where "200.0 MiB" would read as the limit
    with pytest.raises(RecordingError, match=r"is 209,715,201 bytes; uploads are limited to 200 MiB \(209,715,200 "):
        unpack(b"\0" * (200 * 2**20 + 1), tmp_path / "d")


def test_the_page_under_apptest(served, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv(RECORDINGS_ENV, str(served))
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception
    assert at.selectbox(key="rec.name").options == ["float16-grad-scaler", "mlp-sgd", "wrong-version"]
    at.selectbox(key="rec.name").select("float16-grad-scaler").run()
    assert not at.exception and not at.error
    captions = plain(" ".join(c.value for c in at.caption))
    assert "5 steps" in captions and "No finite loss at step 2 (the GradScaler skipped it)" in captions
    at.select_slider(key="rec.step").set_value(2).run()
    assert not at.exception
    assert "ringed in pink" in plain(" ".join(c.value for c in at.caption))  # the overflow step's non-finite nodes
    at.selectbox(key="rec.name").select("wrong-version").run()
    assert not at.exception and len(at.error) == 1
    assert "format version 99" in plain(at.error[0].value)
    assert str(served) not in plain(at.error[0].value)  # the server's paths never reach the browser


def test_the_page_on_a_persons_own_machine_opens_a_typed_path(served, monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest

    monkeypatch.delenv(RECORDINGS_ENV, raising=False)
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception and not at.error
    at.text_input(key="rec.path").input(str(served / "mlp-sgd")).run()
    assert not at.exception and not at.error
    assert "3 steps" in plain(" ".join(c.value for c in at.caption))
    (tmp_path / "notes.txt").write_text("not a recording")
    # the served folder holds three recordings (the fixture's mlp-sgd, float16-grad-scaler, wrong-version): named,
    # where a walkthrough typing a parent folder read only "manifest.json is missing"
    for typed, said in ((str(tmp_path / "notes.txt"), "is not a folder"), (str(tmp_path), "manifest.json is missing"),
                        (str(served), "is not a recording but holds 3: float16-grad-scaler, mlp-sgd, wrong-version; "
                                      "type the folder of one of them")):
        at.text_input(key="rec.path").input(typed).run()
        assert not at.exception and len(at.error) == 1 and said in plain(at.error[0].value), at.error


def test_every_hostile_recording_is_one_sentence_in_the_page(served, monkeypatch, tmp_path):
    """The reader's hostile folders (tests/test_recording_file.py: a wrong version, a pickle renamed, a path in a
    field, a symlinked stream, ...), served and picked in the page: one error each, no traceback, nothing unpickled."""
    from streamlit.testing.v1 import AppTest

    from tests.test_recording_file import HOSTILE

    root = tmp_path / "hostile"
    root.mkdir()
    for kind, spoil in HOSTILE.items():
        shutil.copytree(served / "mlp-sgd", root / kind.replace(" ", "-"), symlinks=True)
        spoil(root / kind.replace(" ", "-"))
    monkeypatch.setenv(RECORDINGS_ENV, str(root))
    marker = Path("/tmp/graphviz_core_pickle_ran")
    marker.unlink(missing_ok=True)
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    for kind in sorted(HOSTILE):
        at.selectbox(key="rec.name").select(kind.replace(" ", "-")).run()
        assert not at.exception, kind
        assert len(at.error) == 1, (kind, [e.value for e in at.error])
        assert "\n" not in at.error[0].value and str(root) not in plain(at.error[0].value), kind
    assert not marker.exists()


def test_old_unpacked_uploads_are_swept_and_nothing_else(tmp_path):
    """An unpacked upload whose session ended is removed once it is older than UPLOAD_MAX_AGE_S (24 h), when the
    next upload is unpacked; a younger one, and a folder not named as an upload, stay."""
    import os

    from graphviz_core.ui.recordings_view import UPLOAD_MAX_AGE_S, UPLOAD_PREFIX, sweep_uploads

    now = 1_000_000_000.0
    old, young, other = tmp_path / f"{UPLOAD_PREFIX}old", tmp_path / f"{UPLOAD_PREFIX}young", tmp_path / "someone-old"
    for folder, age in ((old, UPLOAD_MAX_AGE_S + 60), (young, UPLOAD_MAX_AGE_S - 60), (other, 10 * UPLOAD_MAX_AGE_S)):
        (folder / "run").mkdir(parents=True)
        (folder / "run" / "manifest.json").write_text("{}")
        os.utime(folder, (now - age, now - age))
    assert sweep_uploads(now=now, temp=str(tmp_path)) == [old.name]
    assert not old.exists() and young.exists() and other.exists()


def test_another_recording_opens_at_its_own_first_and_last_steps(served, monkeypatch):
    """Step A and B start at the first and last step of the recording on screen: after the 5-step float16 loop
    (steps 0-4, B at 4) the MLP loop opens with B at its own last step, not at the 4 the other left (in the browser
    Streamlit kept it: tests/test_browser_recordings.py)."""
    from streamlit.testing.v1 import AppTest

    from graphviz_core.graph.recording import open_recording

    last = open_recording(served / "mlp-sgd").steps()[-1].step
    assert last != 4
    monkeypatch.setenv(RECORDINGS_ENV, str(served))
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    at.selectbox(key="rec.name").select("float16-grad-scaler").run()
    at.select_slider[0].set_value(2).run()
    boxes = {s.label: s.value for s in at.selectbox}
    assert (boxes["Step A"], boxes["Step B"]) == (0, 4)
    at.selectbox(key="rec.name").select("mlp-sgd").run()
    boxes = {s.label: s.value for s in at.selectbox}
    assert not at.exception and (boxes["Step A"], boxes["Step B"]) == (0, last)
    assert at.select_slider[0].value == 0  # the step graph's slider starts at the first step again, not at 2


def test_a_layer_that_got_no_gradient_keeps_its_row_in_the_charts(tmp_path):
    """The detached adapter's layer has no figure in the recording (the recorder writes one only for a gradient), so
    the per-layer charts and the two-steps table left it out, where the page says NaN, inf and zero have colours
    of their own (a walkthrough). Its row now says "no gradient" at every step, beside the base layer's norms."""
    from graphviz_core.analysis.gradient_flow import no_gradient_layers
    from tests.recorded_loops import mlp_detached_adapter

    mlp_detached_adapter(tmp_path / "run", steps=2)
    recording = open_recording(tmp_path / "run")
    steps = recording.steps()
    missing = no_gradient_layers(recording)
    assert missing == {0: {"adapter"}, 1: {"adapter"}}  # adapter.weight and adapter.bias, both steps
    for figure in ("grad_norm", "update_ratio"):
        table = layer_table(steps, figure, missing)
        adapter = table[table["layer"] == "adapter"]
        assert list(adapter["step"]) == [0, 1] and set(adapter["shown"]) == {"no gradient"}
        assert "base" in set(table["layer"]) and "adapter" not in set(layer_table(steps, figure)["layer"])


def test_the_upload_box_says_and_keeps_the_servers_limit_where_it_is_smaller(monkeypatch):
    """`make serve` keeps Streamlit's server.maxUploadSize at 1 (MB, which Streamlit counts in MiB), and Streamlit
    refuses any upload over it whatever the box's own limit: the box said "at most 200 MiB" there and a 1.5 MB recording
    came back "status code 413". It says and keeps the smaller of its 200 and the server's."""
    from streamlit import config
    from streamlit.testing.v1 import AppTest

    monkeypatch.delenv(RECORDINGS_ENV, raising=False)
    before = config.get_option("server.maxUploadSize")
    try:
        for server, shown in ((1, 1), (200, 200), (500, 200)):  # min(200, server)
            config.set_option("server.maxUploadSize", server)
            at = AppTest.from_file(PAGE, default_timeout=60).run()
            (box,) = at.get("file_uploader")
            assert box.proto.label == f"or upload a recording's folder as a .zip (at most {shown} MiB)"
            assert box.proto.max_upload_size_mb == shown
    finally:
        config.set_option("server.maxUploadSize", before)
