"""The Recordings page: a recorded training loop (graph/recording.py) opened in the app (docs/recording.md).

What it shows: the loss over steps; heatmaps of the gradient norm and of the update/weight ratio per layer over steps
(log colour scale; NaN, +inf and zero each in a colour of their own, never dropped); a step's autograd graph drawn by
the explorer's renderer with every node coloured by that step's recorded figures (nodes with a NaN or inf gradient
ringed); two steps side by side, layer by layer.

Where recordings come from:
- On a team server (GRAPHVIZ_CORE_RECORDINGS names a folder; docs/team-server.md) the page lists the recordings in that
  folder and opens nothing else: a name is taken only from the listing, and a recording holding a symlink, or one whose
  real path is outside the folder, is refused.
- Otherwise (a person's own machine) also a folder's path typed in, or a recording uploaded as a .zip of its folder
  (at most MAX_UPLOAD_BYTES, unpacked at most MAX_UNPACKED_BYTES).
A recording the reader cannot read is one sentence on the page (RecordingError), never a traceback.
"""

from __future__ import annotations

import math
import os
import tempfile
import zipfile
from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

from graphviz_core.analysis.gradient_flow import analyse, layer_figures, no_gradient_layers
from graphviz_core.export.render import METRICS, metric_range
from graphviz_core.graph.recording import MANIFEST, Recording, RecordingError, open_recording
from graphviz_core.ui.charts import show_chart
from graphviz_core.ui.findings import (
    PLACED_AT_MOST,
    finding_label,
    placed,
    show_findings,
    show_gradients,
    show_recorded_graph,
)
from graphviz_core.ui.format import escape_markdown
from graphviz_core.ui.serve import MAX_UPLOAD_BYTES, RECORDINGS_ENV
from graphviz_core.units import format_bytes, some_of

MAX_UNPACKED_BYTES = 1024 * 2**20
MAX_ENTRIES = 20_000  # files and folders walked in one recording (gpt2-small's 100 steps: ~10)
MAX_LISTED = 500
# the heatmaps' colours outside the log scale; "no gradient": a layer whose trainable parameters got none that step
SPECIAL = {"NaN": "#e6007e", "+inf": "#000000", "zero": "#b0b0b0", "no gradient": "#ff7f0e"}
GRAPH_METRICS = ("grad_norm", "time_s")
HEATMAP_MARGIN_PX = 130  # the step axis, its title and the legend of colours off the scale, below the rows


# ---- where a recording comes from ---------------------------------------------------------------------------------
def configured_folder() -> Path | None:
    value = os.environ.get(RECORDINGS_ENV, "").strip()
    return Path(value) if value else None


def listed_recordings(root: Path) -> list[str]:
    """The recordings in `root`: its sub-folders (not symlinks) that hold a manifest, by name, at most MAX_LISTED."""
    names = []
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and os.path.isfile(os.path.join(entry.path, MANIFEST)):
                names.append(entry.name)
    return sorted(names)[:MAX_LISTED]


def contained(folder: Path, root: Path | None = None, itself: bool = False) -> Path:
    """`folder`, checked: no symlink anywhere in it, at most MAX_ENTRIES entries, and (with `root`) its real path
    inside `root`'s (or `root` itself, with `itself`: an upload whose manifest is at the top of the .zip).
    RecordingError with one sentence otherwise."""
    if folder.is_symlink():
        raise RecordingError(f"{folder.name} is a symlink; only recordings stored in the folder itself are opened.")
    real = Path(os.path.realpath(folder))
    root_real = Path(os.path.realpath(root)) if root is not None else None
    if root_real is not None and root_real not in real.parents and not (itself and real == root_real):
        raise RecordingError(f"{folder.name} is outside the recordings folder; it is not opened.")
    seen = 0
    for path, dirs, files in os.walk(real, followlinks=False):
        for name in dirs + files:
            seen += 1
            if seen > MAX_ENTRIES:
                raise RecordingError(f"{folder.name} holds more than {MAX_ENTRIES:,} files; it is not a recording.")
            if os.path.islink(os.path.join(path, name)):
                raise RecordingError(f"{folder.name} holds a symlink ({name}); a recording never does, so it is not "
                                     f"opened.")
    return real


def unpack(data: bytes, into: Path) -> Path:
    """A .zip of a recording's folder unpacked into `into`; the folder that holds the manifest. Refused with a
    sentence: too big, not a zip, a member named with `..` or from `/`, a symlink, more than MAX_ENTRIES members."""
    if len(data) > MAX_UPLOAD_BYTES:
        raise RecordingError(f"the file is {len(data):,} bytes; uploads are limited to {MAX_UPLOAD_BYTES // 2**20} MiB "
                             f"({MAX_UPLOAD_BYTES:,} bytes).")
    import io

    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        raise RecordingError("the upload is not a .zip file; zip the recording's folder and upload that.") from None
    if len(members) > MAX_ENTRIES:
        raise RecordingError(f"the .zip holds {len(members):,} files, more than a recording's {MAX_ENTRIES:,}.")
    if sum(m.file_size for m in members) > MAX_UNPACKED_BYTES:
        raise RecordingError(f"the .zip unpacks to more than {format_bytes(MAX_UNPACKED_BYTES)}; it is not opened.")
    for member in members:
        parts = Path(member.filename).parts
        if member.filename.startswith(("/", "\\")) or ".." in parts or (member.external_attr >> 16) & 0o170000 == 0o120000:
            raise RecordingError(f"the .zip holds {member.filename!r}, a path outside its folder or a symlink; it is "
                                 f"not opened.")
    try:
        archive.extractall(into)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        raise RecordingError("the .zip is damaged; it could not be unpacked.") from None
    found = sorted(p.parent for p in into.rglob(MANIFEST))
    if not found:
        raise RecordingError(f"the .zip holds no {MANIFEST}: it is not a recording's folder.")
    if len(found) > 1:
        names = some_of(("its top" if f == into else str(f.relative_to(into)) for f in found), 3)
        raise RecordingError(f"the .zip holds {len(found)} recordings ({names}); upload one recording's folder.")
    return found[0]


@st.cache_resource(max_entries=8, show_spinner=False)
def _opened(path: str, signature: tuple) -> Recording:
    return open_recording(path)


def _signature(folder: Path) -> tuple:
    """What changes as a recording grows (a run still writing): each rank's streams' sizes."""
    out = []
    for rank in sorted(folder.glob("rank-*"))[:64]:
        out += [(rank.name, f.name, f.stat().st_size) for f in sorted(rank.iterdir())[:8] if f.is_file()]
    return tuple(out)


def pick_recording() -> Recording | None:
    """The recording the visitor chose, opened; None (with a sentence where something went wrong) otherwise."""
    root = configured_folder()
    try:
        folder = _served(root) if root is not None else _local()
        if folder is None:
            return None
        return _opened(str(folder), _signature(folder))
    except RecordingError as exc:
        st.error(escape_markdown(said(exc)))
    except OSError as exc:
        st.error(escape_markdown(said(f"the recording could not be read: {exc.strerror or exc}.")))
    return None


def said(message: object) -> str:
    """A refusal as the browser may see it: on a team server, every path under the recordings folder (or an upload's
    temporary folder) cut to its part below that folder; the server's own paths never reach a browser."""
    text = str(message)
    prefixes = [str(p) for p in (configured_folder(), st.session_state.get("rec.unpacked", (None, None))[1]) if p]
    for prefix in sorted({q for p in prefixes for q in (p, os.path.realpath(p))}, key=len, reverse=True):
        text = text.replace(prefix.rstrip("/") + "/", "").replace(prefix, "(the folder)")
    return text


def _served(root: Path) -> Path | None:
    if not root.is_dir():
        st.error(escape_markdown(f"The recordings folder this server was given ({RECORDINGS_ENV}) does not exist."))
        return None
    names = listed_recordings(root)
    if not names:
        st.info("No recording in this server's recordings folder yet.")
        return None
    st.caption("Recordings in this server's recordings folder (docs/team-server.md); nothing outside it is opened.")
    name = st.selectbox("Recording", names, key="rec.name")
    if name not in names:  # a stale choice from another session's list
        return None
    return contained(root / name, root)


UPLOAD_PREFIX = "graphviz-core-upload-"
UPLOAD_MAX_AGE_S = 24 * 3600  # an unpacked upload older than this is removed when the next one is unpacked


def _remove_upload(folder: Path) -> None:
    import shutil

    if Path(folder).name.startswith(UPLOAD_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)


def sweep_uploads(now: float | None = None, temp: str | None = None) -> list[str]:
    """Remove unpacked uploads older than UPLOAD_MAX_AGE_S from the temporary folder (a session that ended never
    removed its own); the names removed."""
    import time

    now = time.time() if now is None else now
    removed = []
    root = Path(temp or tempfile.gettempdir())
    for folder in root.glob(UPLOAD_PREFIX + "*"):
        try:
            if folder.is_dir() and not folder.is_symlink() and now - folder.stat().st_mtime > UPLOAD_MAX_AGE_S:
                _remove_upload(folder)
                removed.append(folder.name)
        except OSError:
            continue
    return removed


def upload_limit_mib() -> int:
    """The upload box's limit in MiB (Streamlit's "MB"): MAX_UPLOAD_BYTES, or the server's own where it is smaller
    (`make serve` keeps config.toml's 1: Streamlit refuses anything over it, whatever the box says)."""
    return min(MAX_UPLOAD_BYTES // 2**20, int(st.get_option("server.maxUploadSize")))


def _local() -> Path | None:
    typed = st.text_input("Recording folder on this machine", key="rec.path",
                          placeholder="e.g. runs/exp1 (the folder graphviz_core.record wrote)")
    limit = upload_limit_mib()
    upload = st.file_uploader(f"or upload a recording's folder as a .zip (at most {limit} MiB)",
                              type=["zip"], key="rec.upload", max_upload_size=limit)
    kept = st.session_state.get("rec.unpacked")
    if kept is not None and (upload is None or kept[0] != upload.file_id):
        st.session_state.pop("rec.unpacked")  # removed or replaced: its unpacked copy goes with it
        _remove_upload(kept[2])
    if upload is not None:
        kept = st.session_state.get("rec.unpacked")
        if kept is None:  # unpacked once per upload, not on every rerun
            sweep_uploads()
            into = Path(tempfile.mkdtemp(prefix=UPLOAD_PREFIX))
            try:
                found = contained(unpack(upload.getvalue(), into), into, itself=True)
            except BaseException:
                _remove_upload(into)
                raise
            st.session_state["rec.unpacked"] = kept = (upload.file_id, found, into)
        return kept[1]
    if typed.strip():
        folder = Path(typed.strip()).expanduser()
        if not folder.is_dir():
            raise RecordingError(f"{typed.strip()} is not a folder on this machine.")
        if not (folder / MANIFEST).exists():  # a folder of recordings: name them, where "manifest.json is missing"
            try:
                inside = listed_recordings(folder)
            except OSError:
                inside = []
            if inside:
                names = some_of(inside, 5)
                many = f"{len(inside):,} or more" if len(inside) >= MAX_LISTED else f"{len(inside):,}"  # listed at most
                raise RecordingError(f"{typed.strip()} is not a recording but holds {many}: {names}; type the folder "
                                     f"of one of them.")
        return folder
    st.info("Type the folder of a recording, or upload one. To record your own loop: docs/recording.md.")
    return None


# ---- figures per layer ------------------------------------------------------------------------------------------------
def kind_of(value: float | None) -> str | None:
    """Where a value goes in a heatmap: "finite" (the log scale), "NaN", "+inf", "zero"; None: no value."""
    if value is None:
        return None
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+inf"
    return "zero" if value == 0 else "finite"


def layer_table(steps: list, figure: str, missing: dict[int, set[str]] | None = None) -> pd.DataFrame:
    """One row per (step, layer) of gradient_flow.layer_figures' `figure`, with where it goes in the heatmap; and
    one "no gradient" row for each layer of `missing` (gradient_flow.no_gradient_layers) without a figure that step
    (a detached or unused layer has none, and would otherwise be left out of the charts)."""
    rows, order, seen = [], {}, set()
    for step, layer, value in layer_figures(steps, figure):
        order.setdefault(layer, len(order))
        seen.add((step, layer))
        kind = kind_of(value)
        if kind is not None:
            rows.append({"step": step, "layer": layer, "kind": kind, "order": order[layer],
                         "value": value if kind == "finite" else None,
                         "shown": f"{value:.4g}" if kind == "finite" else kind})
    for step in steps:
        for layer in sorted((missing or {}).get(step.step, ())):
            if (step.step, layer) not in seen:
                order.setdefault(layer, len(order))
                rows.append({"step": step.step, "layer": layer, "kind": "no gradient", "order": order[layer],
                             "value": None, "shown": "no gradient"})
    return pd.DataFrame(rows, columns=["step", "layer", "kind", "order", "value", "shown"])


def log_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Values to label a log colour scale from `low` to `high` (both > 0) with: both ends as they are, and between them
    up to count - 2 evenly spaced on the log scale, rounded to two significant digits. Vega-Lite's own pick could
    leave a range within one decade with a single label: the MLP loop's gradient norms, 0.383 to 1.01, read "1" alone."""
    if high <= low:
        return [low]
    inner = []
    for i in range(1, count - 1):
        value = low * (high / low) ** (i / (count - 1))
        rounded = float(f"{value:.2g}")
        if low < rounded < high and rounded not in inner:
            inner.append(rounded)
    return [low, *inner, high]


def heatmap(table: pd.DataFrame, title: str) -> alt.LayerChart:
    """Layers down, steps across; finite values on a log colour scale (labelled at both ends and between,
    log_ticks), NaN / +inf / zero in their own colours."""
    layers = list(table.sort_values("order")["layer"].drop_duplicates())
    values = table.loc[table["kind"] == "finite", "value"]
    ticks = log_ticks(float(values.min()), float(values.max())) if len(values) else None
    height = max(120, min(18 * len(layers), 720))
    base = alt.Chart(table).encode(
        x=alt.X("step:O", title="optimizer step", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("layer:N", sort=layers, title="layer"),
        tooltip=[alt.Tooltip("layer:N"), alt.Tooltip("step:O"), alt.Tooltip("shown:N", title=title)])
    finite = base.transform_filter(alt.datum.kind == "finite").mark_rect().encode(
        color=alt.Color("value:Q", scale=alt.Scale(type="log", scheme="viridis"), title=[title, "(log scale)"],
                        legend=alt.Legend(values=ticks, format=".3~g") if ticks else alt.Legend(format=".3~g")))
    present = [kind for kind in SPECIAL if (table["kind"] == kind).any()]  # the legend names only what is drawn
    special = base.transform_filter(alt.datum.kind != "finite").mark_rect().encode(
        color=alt.Color("kind:N", scale=alt.Scale(domain=present or list(SPECIAL),
                                                  range=[SPECIAL[k] for k in present or SPECIAL]),
                        title="not on the scale", legend=alt.Legend(orient="bottom") if present else None))
    return alt.layer(finite, special).resolve_scale(color="independent").properties(height=height)


def loss_chart(steps: list) -> alt.LayerChart:
    """The loss, its line broken where a step has no finite loss; such a step marked by a red rule."""
    rows, segment = [], 0
    for s in steps:
        if s.loss is None:
            segment += 1
        rows.append({"step": s.step, "loss": s.loss, "segment": segment,
                     "why": "skipped by the GradScaler" if s.skipped else "no finite loss"})
    frame = pd.DataFrame(rows, columns=["step", "loss", "segment", "why"])
    x = alt.X("step:Q", title="optimizer step", axis=alt.Axis(tickMinStep=1))
    line = alt.Chart(frame).transform_filter("isValid(datum.loss)").mark_line(point=True).encode(
        x=x, y=alt.Y("loss:Q", title="loss"), detail="segment:N",
        tooltip=["step", alt.Tooltip("loss:Q", format=".4g")])
    gaps = alt.Chart(frame).transform_filter("!isValid(datum.loss)").mark_rule(color=SPECIAL["NaN"], strokeDash=[4, 3]
                                                                              ).encode(x=x, tooltip=["step", "why"])
    return alt.layer(line, gaps).properties(height=220)


# ---- the page -----------------------------------------------------------------------------------------------------------
def show_recording(recording: Recording) -> None:
    """Everything the page shows of one recording; a figure the reader refuses is one sentence."""
    try:
        _show(recording)
    except RecordingError as exc:
        st.error(escape_markdown(said(exc)))


# The page's step controls belong to the recording on screen: another recording opened gets controls of its own, at
# their defaults (a step B of 4 kept from a 5-step recording would otherwise stay on a 6-step one, not its last step;
# Streamlit keeps a keyed widget's value in the browser, so the keys change rather than the values being dropped): the
# rank, the step and its backward, steps A and B, the finding opened and its node.


def _forget_other_recordings(recording: Recording) -> None:
    shown = str(recording.path)
    if st.session_state.get("rec.shown") not in (None, shown):
        st.session_state["rec.generation"] = st.session_state.get("rec.generation", 0) + 1
    st.session_state["rec.shown"] = shown


def _key(name: str) -> str:
    """A step control's key for the recording on screen."""
    generation = st.session_state.get("rec.generation", 0)
    return name if not generation else f"{name}~{generation}"


def _show(recording: Recording) -> None:
    _forget_other_recordings(recording)
    rank = 0 if len(recording.ranks) == 1 else st.selectbox("Rank", recording.ranks, key=_key("rec.rank"))
    steps = recording.steps(rank)
    recording.node_figures(rank)  # the per-node figures agree with the steps, or one sentence now
    state = "complete" if recording.complete else "incomplete: the run stopped before the recorder closed"
    st.caption(escape_markdown(f"{len(steps)} steps · rank {rank} of {len(recording.ranks)} · {state} · torch "
                               f"{recording.manifest.get('torch', '?')}"))
    if not steps:
        st.info("This recording holds no complete step yet.")
        return
    st.subheader("Loss over steps")
    show_chart(loss_chart(steps))
    missing = [s for s in steps if s.loss is None]
    if missing:
        st.caption(escape_markdown("No finite loss at step " + ", ".join(
            f"{s.step}{' (the GradScaler skipped it)' if s.skipped else ''}" for s in missing) + " (the pink dashed "
            "line)."))
    st.subheader("Gradient norm per layer")
    st.caption("The L2 norm of each layer's whole gradient as the optimizer stepped with it (unscaled under a "
               "GradScaler). NaN, +inf, zero and no gradient at all (a layer detached or never run) are drawn in "
               "their own colours.")
    missing = _no_gradient(str(recording.path), _signature(recording.path), rank)
    _show_heatmap(heatmap(layer_table(steps, "grad_norm", missing), "gradient norm"))
    st.subheader("Update / weight ratio per layer")
    st.caption("How far each optimizer step moved a layer's weights: the norm of the change over the norm of the "
               "weights before it. Empty where a step had no update (skipped by the GradScaler, or closed by hand) or the weights were all zero.")
    _show_heatmap(heatmap(layer_table(steps, "update_ratio", missing), "update / weight"))
    _show_findings(recording, rank)
    _step_graph(recording, steps, rank)
    _two_steps(recording, steps, rank, missing)


@st.cache_resource(max_entries=8, show_spinner=False)
def _findings(path: str, signature: tuple) -> list[dict]:
    return analyse(_opened(path, signature))["findings"]


@st.cache_resource(max_entries=8, show_spinner=False)
def _no_gradient(path: str, signature: tuple, rank: int) -> dict[int, set[str]]:
    return no_gradient_layers(_opened(path, signature), rank)


def _graph_of(recording: Recording, finding: dict, rank: int):
    """The recorded graph a finding's step ran (its backward's; the first where it names none), or None."""
    try:  # a step without per-node figures, or without that backward, is refused by step_graph itself
        return recording.step_graph(finding.get("step"), rank, finding.get("backward", 0))
    except RecordingError:
        return None


def _show_findings(recording: Recording, rank: int) -> None:
    st.subheader("Findings")
    st.caption("Gradient-flow debugging of this recording (docs/debugging.md): where a NaN or inf started, parameters "
               "that got no gradient and why, dead units, vanishing or exploding layers, steps the GradScaler skipped.")
    mine = [f for f in _findings(str(recording.path), _signature(recording.path)) if f.get("rank", 0) == rank]
    if not mine:
        st.success("No finding: every gradient was finite, every trainable parameter got one, no layer vanished or "
                   "exploded by the stated rules.")
        return
    show_findings(mine)
    at_nodes = placed(mine, lambda f: _graph_of(recording, f, rank))
    if len(mine) > PLACED_AT_MOST:
        st.caption(f"The list below offers the first {PLACED_AT_MOST} of the {len(mine):,} findings.")
    if not at_nodes:
        return
    labels = [finding_label(f) for f, _ in at_nodes]

    def opened() -> None:
        chosen = st.session_state.get(_key("rec.finding"))
        found = next((pair for pair, label in zip(at_nodes, labels, strict=True) if label == chosen), None)
        if found is None:
            st.session_state.pop(_key("rec.focus"), None)
            return
        finding, node = found
        st.session_state[_key("rec.step")] = finding["step"]
        st.session_state[_key("rec.backward")] = finding.get("backward", 0)
        st.session_state[_key("rec.focus")] = (finding["step"], finding.get("backward", 0), node)

    chosen = st.selectbox("Open a finding at its node in the step's graph below", labels, index=None,
                          key=_key("rec.finding"), placeholder="Choose a finding", on_change=opened)
    shown = next((f for (f, _), label in zip(at_nodes, labels, strict=True) if label == chosen), None)
    if shown is not None:
        show_gradients(shown)


def _show_heatmap(chart: alt.LayerChart) -> None:
    """At its own height plus its axis and the legend below it (show_chart's 80 px left the rows ~9 px tall)."""
    st.altair_chart(chart, width="stretch", height=chart.height + HEATMAP_MARGIN_PX)


def _step_graph(recording: Recording, steps: list, rank: int) -> None:
    st.subheader("One step's autograd graph")
    row = st.columns([2, 1, 1])
    step = row[0].select_slider("Step", [s.step for s in steps], key=_key("rec.step"))
    record = next(s for s in steps if s.step == step)
    if not record.backward_graphs:
        st.info(f"Step {step} recorded no per-node figures (recorded with parameters only, or a step that nodes_every "
                "left out).")
        return
    backward = row[1].selectbox("Backward (micro-batch)", range(len(record.backward_graphs)), key=_key("rec.backward"))
    colour = row[2].selectbox("Colour by", GRAPH_METRICS, key="rec.colour", format_func=METRICS.get)
    graph = recording.step_graph(step, rank, backward)
    wanted = st.session_state.get(_key("rec.focus"))  # (step, backward, node) of the finding opened; only on that graph
    focus = wanted[2] if isinstance(wanted, tuple) and wanted[:2] == (step, backward) else None
    show_recorded_graph(graph, focus, colour, title=f"step {step}, backward {backward}",
                        subtitle=f"recorded rank {rank}", at=f" at step {step}")


def _two_steps(recording: Recording, steps: list, rank: int, missing: dict[int, set[str]]) -> None:
    if len(steps) < 2:
        return
    st.subheader("Two steps side by side")
    row = st.columns(2)
    numbers = [s.step for s in steps]
    a = row[0].selectbox("Step A", numbers, index=0, key=_key("rec.a"))
    b = row[1].selectbox("Step B", numbers, index=len(numbers) - 1, key=_key("rec.b"))
    table = {}
    for label, number in (("A", a), ("B", b)):
        chosen = [s for s in steps if s.step == number]
        for figure, title in (("grad_norm", "gradient norm"), ("update_ratio", "update / weight")):
            for _, r in layer_table(chosen, figure, missing).iterrows():
                table.setdefault(r["layer"], {})[f"{title}, step {number} ({label})"] = r["shown"]
    frame = pd.DataFrame.from_dict(table, orient="index").fillna("n/a")
    frame.index.name = "layer"
    st.dataframe(frame, width="stretch")
    if st.toggle("Draw both steps' graphs, one colour scale for the two", key="rec.both"):
        _two_graphs(recording, steps, rank, (a, b))


def _two_graphs(recording: Recording, steps: list, rank: int, numbers: tuple[int, int]) -> None:
    """Steps A and B's graphs (each's first backward), A above B, coloured on one scale: a node as dark in both had the
    same figure."""
    records = {s.step: s for s in steps}
    without = [n for n in numbers if not records[n].backward_graphs]
    if without:
        st.info(f"Step {', '.join(map(str, without))} recorded no per-node figures (recorded with parameters only, or "
                "a step that nodes_every left out): no graph to draw.")
        return
    colour = st.selectbox("Colour both by", GRAPH_METRICS, key="rec.both_colour", format_func=METRICS.get)
    graphs = [recording.step_graph(n, rank, 0) for n in numbers]
    shared = metric_range(graphs, colour)
    # One above the other at the page's width: in half a page the graph's pane left a laptop's screen too narrow to read.
    for label, number, graph in zip("AB", numbers, graphs, strict=True):
        show_recorded_graph(graph, None, colour, title=f"step {number} ({label})", subtitle=f"recorded rank {rank}",
                            at=f" at step {number}", colour_range=shared)
