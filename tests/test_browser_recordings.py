"""The Recordings page in headless Chromium, on a server whose recordings folder (GRAPHVIZ_CORE_RECORDINGS) holds the
three real loops the recorder's tests record (MLP + SGD, GPT-2 + AdamW with 4-step accumulation, float16 autocast +
GradScaler with a skipped step) and a broken one: each opens with its charts and a step's graph, no page error, no
request outside the server; the broken one is one sentence. Photographed at 1280x800 and 1920x1080."""

import json
import os
import shutil

import pytest

from graphviz_core.analysis.gradient_flow import analyse
from graphviz_core.graph.recording import open_recording
from graphviz_core.ui.browser_harness import graph_frame, serve_app
from graphviz_core.ui.recordings_view import RECORDINGS_ENV, finding_label
from tests.conftest import LAPTOP, both_sizes, choose, idle
from tests.recorded_loops import LOOPS, mlp_detached_adapter, mlp_nan_fault

pytestmark = pytest.mark.browser
SHOTS = os.environ.get("GRAPHVIZ_CORE_SHOTS")  # where to keep the screenshots (default: pytest's tmp folder)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("recordings")
    for name, loop in LOOPS.items():
        loop(root / name)
    mlp_nan_fault(root / "nan-fault")
    mlp_detached_adapter(root / "mlp-detached")
    shutil.copytree(root / "mlp-sgd", root / "truncated")
    (root / "truncated" / "graphs").rename(root / "truncated" / "gone")  # its graph files missing
    with serve_app({"GRAPHVIZ_CORE_DEVICE": "cpu", RECORDINGS_ENV: str(root)},
                   log=tmp_path_factory.mktemp("app") / "server.log") as url:
        yield url, root


def _open(page, url: str, name: str) -> None:
    outside = []
    page.on("request", lambda r: outside.append(r.url) if not r.url.startswith((url, "data:", "about:", "blob:"))
            else None)
    page.goto(f"{url}/recordings")
    box = page.get_by_role("combobox", name="Recording")
    box.wait_for(timeout=60_000)
    choose(page, box, name)
    idle(page, settle_ms=1000)
    page.outside = outside


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
@pytest.mark.parametrize("name", list(LOOPS))
def test_each_real_loop_opens_in_the_page(page, server, name, tmp_path):
    url, root = server
    _open(page, url, name)
    recording = open_recording(root / name)
    first = recording.step_graph(recording.steps()[0].step)
    frame = graph_frame(page, first.number_of_nodes(), timeout_s=90)  # step 0's graph, every node drawn
    charts = page.locator('[data-testid="stVegaLiteChart"]')
    charts.nth(2).wait_for(timeout=30_000)
    assert charts.count() == 3  # the loss, the gradient-norm heatmap, the update-ratio heatmap
    assert page.locator('[data-testid="stException"]').count() == 0
    assert page.locator('[data-testid="stAlert"]').filter(has_text="cannot").count() == 0
    text = page.locator('[data-testid="stMain"]').inner_text()
    assert f"{len(recording.steps())} steps" in text
    if name == "float16-grad-scaler":
        assert "No finite loss at step 2 (the GradScaler skipped it)" in text
    # the colours the nodes are drawn in: the recorded gradient norms' scale, not the categories'
    fills = frame.evaluate("window.network.body.data.nodes.get().map(n => n.color.background)")
    assert len(set(fills)) > 2
    shots = os.path.join(SHOTS or str(tmp_path), f"recordings-{name}")
    both_sizes(page, shots)
    charts.nth(1).scroll_into_view_if_needed()
    both_sizes(page, f"{shots}-heatmaps")
    page.locator("iframe").last.scroll_into_view_if_needed()
    both_sizes(page, f"{shots}-graph")
    assert not page.outside, page.outside


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_a_broken_recording_is_one_sentence(page, server):
    url, _ = server
    _open(page, url, "truncated")
    alerts = page.locator('[data-testid="stAlert"]')
    alerts.first.wait_for(timeout=30_000)
    assert alerts.count() == 1 and page.locator('[data-testid="stException"]').count() == 0
    assert "missing" in alerts.first.inner_text()
    json.dumps(page.outside)
    assert not page.outside


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_a_finding_opens_at_its_node_with_the_path_from_the_loss(page, server, tmp_path):
    """The NaN injected at step 2 (the square root of an exact zero in the hidden layer): the Findings list names
    SqrtBackward0; choosing it opens step 2's graph with that node selected, its details shown, and the nodes from the
    loss down to it ringed."""
    url, root = server
    _open(page, url, "nan-fault")
    main = page.locator('[data-testid="stMain"]')
    page.get_by_text("Findings", exact=True).wait_for(timeout=30_000)
    box = page.get_by_role("combobox", name="Open a finding at its node in the step's graph below")
    found = [f for f in analyse(open_recording(root / "nan-fault"))["findings"] if f["kind"] == "nonfinite-backward"]
    assert [(f["step"], f["node"]) for f in found] == [(2, "SqrtBackward0")]
    choose(page, box, finding_label(found[0]))
    idle(page, settle_ms=1000)
    graph = open_recording(root / "nan-fault").step_graph(2)
    deadline_frame = graph_frame(page, graph.number_of_nodes(), timeout_s=90)
    shown = deadline_frame.evaluate("() => ({selected: window.network.getSelectedNodes(), "
                                    "details: document.getElementById('details').innerText})")
    assert len(shown["selected"]) == 1
    node = shown["selected"][0]
    assert graph.nodes[node]["op"] == "SqrtBackward0" and "SqrtBackward0" in shown["details"]
    assert "nodes from the loss down to it ringed in pink" in main.inner_text()
    # the NaN's spread below the square root keeps a mark of its own beside the path: dashed, purple off the path
    broken = [n for n, d in graph.nodes(data=True) if d.get("nonfinite")]
    dashed = deadline_frame.evaluate("() => window.network.body.data.nodes.get().filter(n => n.shapeProperties && "
                                     "n.shapeProperties.borderDashes && n.borderWidth === 5).map(n => n.id)")
    assert broken and sorted(dashed) == sorted(broken)
    assert f"the {len(broken):,} nodes with a NaN or inf gradient dashed" in main.inner_text()
    # its gradients in and out, and the tensor it saved: the hidden layer's 6 examples x 16 units, float32; its saved
    # result is sqrt(0) = 0 everywhere (0 NaN or inf); what it returned holds 6 x 16 NaN (0 / (2 * 0))
    table_box = page.locator('[data-testid="stTable"]').filter(has_text="gradient received from")
    table = table_box.inner_text()
    assert "gradient received from MulBackward0" in table and "gradient returned to SubBackward0" in table, table
    assert "saved tensor result" in table and table.count("(6, 16)") == 3 and "float32" in table, table
    assert page.locator('[data-testid="stException"]').count() == 0
    table_box.scroll_into_view_if_needed()
    both_sizes(page, os.path.join(SHOTS or str(tmp_path), "recordings-finding"))
    page.locator("iframe").last.scroll_into_view_if_needed()
    both_sizes(page, os.path.join(SHOTS or str(tmp_path), "recordings-finding-graph"))
    assert not page.outside, page.outside


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_a_detached_adapter_opens_at_the_node_its_cut_output_entered(page, server, tmp_path):
    """The adapter's output detached before `base(x) + adapter(x)`: its weight's no-gradient finding opens at that
    AddBackward0 (selected, its details shown, the path from the loss ringed), the node beside base's matmul."""
    url, root = server
    _open(page, url, "mlp-detached")
    page.get_by_text("Findings", exact=True).wait_for(timeout=30_000)
    found = {f["parameter"]: f for f in analyse(open_recording(root / "mlp-detached"))["findings"]
             if f["kind"] == "no-gradient"}
    assert set(found) == {"adapter.weight", "adapter.bias"}
    box = page.get_by_role("combobox", name="Open a finding at its node in the step's graph below")
    choose(page, box, finding_label(found["adapter.weight"]))
    idle(page, settle_ms=1000)
    graph = open_recording(root / "mlp-detached").step_graph(found["adapter.weight"]["step"])
    frame = graph_frame(page, graph.number_of_nodes(), timeout_s=90)
    shown = frame.evaluate("() => ({selected: window.network.getSelectedNodes(), "
                           "details: document.getElementById('details').innerText})")
    assert shown["selected"] == [found["adapter.weight"]["node_id"]]
    node = shown["selected"][0]
    assert graph.nodes[node]["op"] == "AddBackward0" and "AddBackward0" in shown["details"]
    assert [graph.nodes[c]["module"] for c in graph.successors(node)] == ["base"]
    assert "the finding's node AddBackward0 selected" in page.locator('[data-testid="stMain"]').inner_text()
    assert found["adapter.weight"]["reason"].startswith("cut by detach")
    # the finding opened says its whole reason (the findings table above cuts a long one at its column's width)
    said = page.locator('[data-testid="stAlert"]').filter(has_text="no-gradient at step").inner_text()
    assert "parameter adapter.weight" in said and found["adapter.weight"]["reason"].rstrip(".") in said, said
    assert page.locator('[data-testid="stException"]').count() == 0
    page.locator("iframe").last.scroll_into_view_if_needed()
    both_sizes(page, os.path.join(SHOTS or str(tmp_path), "recordings-cut"))
    assert not page.outside, page.outside


def _zipped(folder, top: str = "run/", padding: int = 0) -> bytes:
    """`folder` as a .zip, its files under `top` ("" for zip -r's `cd run && zip -r ../run.zip .`), with `padding`
    random bytes in a file of its own (notes.bin: stored as they are, random bytes do not compress)."""
    import io
    import zipfile

    data = io.BytesIO()
    with zipfile.ZipFile(data, "w") as archive:
        for path in folder.rglob("*"):
            if path.is_file():
                archive.write(path, f"{top}{path.relative_to(folder)}")
        if padding:
            archive.writestr(f"{top}notes.bin", os.urandom(padding))
    return data.getvalue()


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_an_upload_opens_and_a_hostile_one_is_a_sentence(page, server, tmp_path_factory, tmp_path):
    """On a person's own machine (no recordings folder configured) the page takes a recording's folder as a .zip
    through its uploader: the MLP loop opens with its 6 steps, zipped with its files at the top of the .zip and 1.5 MiB
    over Streamlit's 1 MB default limit (.streamlit/config.toml; both were refused before: "status code 413", and
    "graphviz-core-upload-... is outside the recordings folder"); a pickle renamed .zip is one sentence, no traceback."""
    _, root = server
    with serve_app({"GRAPHVIZ_CORE_DEVICE": "cpu"}, log=tmp_path_factory.mktemp("local") / "server.log") as url:
        page.goto(f"{url}/recordings")
        uploader = page.locator('[data-testid="stFileUploader"] input[type="file"]')
        uploader.wait_for(state="attached", timeout=60_000)
        uploader.set_input_files(files=[{"name": "mlp.zip", "mimeType": "application/zip",
                                         "buffer": _zipped(root / "mlp-sgd", top="", padding=3 * 2**19)}])
        main = page.locator('[data-testid="stMain"]')
        page.get_by_text("6 steps", exact=False).first.wait_for(timeout=60_000)
        idle(page, settle_ms=500)
        assert page.locator('[data-testid="stException"]').count() == 0
        both_sizes(page, os.path.join(SHOTS or str(tmp_path), "recordings-upload"))
        import pickle

        uploader.set_input_files(files=[{"name": "evil.zip", "mimeType": "application/zip",
                                         "buffer": pickle.dumps({"a": 1})}])
        alert = page.locator('[data-testid="stAlert"]').filter(has_text="not a .zip")
        alert.first.wait_for(timeout=60_000)
        assert page.locator('[data-testid="stException"]').count() == 0
        assert "Traceback" not in main.inner_text()
        page.goto("about:blank")  # before this server stops: the page would log its refused health checks


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_two_steps_graphs_side_by_side_on_one_colour_scale(page, server, tmp_path):
    """Two steps side by side: the toggle draws steps A and B's graphs, A above B, both coloured by gradient norm on
    one scale (the legends read the same ends, those of both steps' values together), so a node as dark in both had
    the same gradient norm."""
    from graphviz_core.export.render import format_metric, metric_range

    url, root = server
    _open(page, url, "mlp-sgd")
    recording = open_recording(root / "mlp-sgd")
    steps = [s.step for s in recording.steps()]
    graphs = [recording.step_graph(steps[0]), recording.step_graph(steps[-1])]  # A: the first step, B: the last
    low, high = metric_range(graphs, "grad_norm")
    own = [metric_range([g], "grad_norm") for g in graphs]
    assert own[0] != own[1]  # each step alone would draw its own ends: the shared scale is what the test sees
    page.get_by_text("Draw both steps' graphs, one colour scale for the two").click()
    main = page.locator('[data-testid="stMain"]')
    page.get_by_text("of both steps (one scale for the two)").first.wait_for(timeout=60_000)
    idle(page, settle_ms=1000)
    assert page.locator("iframe").count() == 3  # the step graph above, then A and B
    # B is the last step of this recording, though the page first opened another one (5 steps, its B at step 4)
    assert page.get_by_role("combobox", name="Step B").input_value() == str(steps[-1])
    legends = [page.frame_locator("iframe").nth(i).locator(".scale-ticks").inner_text() for i in (1, 2)]
    assert legends[0] == legends[1]
    ends = legends[0].split()
    assert format_metric("grad_norm", low) in legends[0] and format_metric("grad_norm", high) in legends[0], ends
    assert page.locator('[data-testid="stException"]').count() == 0 and "Traceback" not in main.inner_text()
    for i, name in ((1, "a"), (2, "b")):
        page.locator("iframe").nth(i).scroll_into_view_if_needed()
        both_sizes(page, os.path.join(SHOTS or str(tmp_path), f"recordings-two-steps-{name}"))
    assert not page.outside, page.outside
