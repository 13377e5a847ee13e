"""Recordings of a user's own training loop: the file format (docs/recording.md) and its reader.

A recording is a folder written as the run goes (graphviz_core.capture.recorder writes it):

    manifest.json            what it is: format, format_version, the graph schema version, when, torch's version
    graphs/<id>.json         each distinct autograd graph once: node-link JSON of graph/schema.py's records
    rank-<r>/steps.arrows    Arrow IPC streams, one record batch per optimizer step (the STEPS schema below)
    rank-<r>/parameters.arrows                                  (PARAMETERS: one row per parameter tensor)
    rank-<r>/nodes.arrows                                       (NODES: one row per node of each backward)
    rank-<r>/status.json     {"complete": true, "steps": N} once the recorder closed cleanly

A step is complete when its row is in steps.arrows, which is written last; a run killed mid-step leaves at most a
partial batch at the end of a stream, which the reader drops. No pickle anywhere: JSON and Arrow only, read from
plain files (never through a symlink, nor from a device or a FIFO) with limits on every size, and checked for what
cannot be (a cycle in a graph, a negative norm or count, a step twice): a file from someone else gets one sentence,
`RecordingError`, never code run.

The reader::

    recording = open_recording("runs/exp1")       # RecordingError (a ValueError) with one sentence if it cannot
    recording.complete, recording.ranks, recording.manifest
    steps = recording.steps(rank=0)                # [Step]: step, loss, skipped, peak_bytes, lr, parameters, ...
    graph = recording.step_graph(step=3, rank=0, backward=0)   # the graph with that backward's figures per node
    recording.graph(graph_id)                      # a graph as captured (no per-step figures)
    recording.to_dict()                            # `graphviz-core recording PATH --format json`
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from graphviz_core.graph.schema import SCHEMA_VERSION, NodeRecord

FORMAT = "graphviz-core recording"
FORMAT_VERSION = 2  # what the recorder writes; 2 added the nodes' signed min and max
READS = (1, 2)  # the versions this reader opens
MANIFEST = "manifest.json"
STATUS = "status.json"
GRAPHS = "graphs"
STREAMS = ("steps", "parameters", "nodes")
GRAPH_ID = re.compile(r"^[0-9a-f]{20}$")  # blake2b(ops and edges), 10 bytes in hex: never a path
RANK_DIR = re.compile(r"^rank-(0|[1-9][0-9]{0,4})$")  # rank-<n> as the writer names it: no sign, no leading zero

# Every size the reader reads is bounded.
MAX_JSON_BYTES = 1 << 20  # manifest and status files
MAX_GRAPH_BYTES = 256 << 20  # one graph's JSON (gpt2-small's is ~2 MB)
MAX_GRAPH_NODES = 2_000_000
MAX_STREAM_BYTES = 8 << 30  # one Arrow stream (memory-mapped: read as it is used)
MAX_RANKS = 4096
MAX_FOLDER_ENTRIES = 1_000_000  # entries of the recording folder looked through for its rank folders
MAX_GRAPHS = 10_000


class RecordingError(ValueError):
    """A recording that cannot be read: the message is one sentence that says why."""


def arrow_schemas(version: int = None):
    """The three streams' Arrow schemas of format `version` (default: the one written now; pyarrow imported here: the
    rest of the package does not need it). Version 2 added the nodes' signed `min` and `max`."""
    version = FORMAT_VERSION if version is None else version
    import pyarrow as pa

    steps = pa.schema([
        ("step", pa.int64()),  # 0-based optimizer step
        ("loss", pa.float64()),  # sum of the step's backward roots (unscaled); null if none was a scalar
        ("skipped", pa.bool_()),  # the GradScaler found inf/NaN and skipped the optimizer's step
        ("scale", pa.float64()),  # the GradScaler's scale during the step's backwards; null without one
        ("peak_bytes", pa.int64()),
        ("peak_source", pa.string()),  # "cuda allocator" | "estimate" (docs/recording.md)
        ("lr", pa.float64()),  # the first parameter group's learning rate
        ("lrs", pa.list_(pa.float64())),  # every group's
        ("time_s", pa.float64()),  # wall time since the previous step ended (or the recording started)
        ("backward_graphs", pa.list_(pa.string())),  # each backward of the step: its graph id
        ("backward_nodes", pa.list_(pa.int32())),  # and how many rows of nodes.arrows it has
        ("micro_losses", pa.list_(pa.float64())),  # each backward's root value (unscaled; NaN if not a scalar)
        ("micro_grad_norms", pa.list_(pa.float64())),  # each backward's gradient into the parameters, L2
        ("grad_norm", pa.float64()),  # the whole gradient the optimizer stepped with, L2 over every parameter
    ])
    parameters = pa.schema([
        ("step", pa.int64()),
        ("name", pa.string()),
        ("grad_norm", pa.float64()),
        ("weight_norm", pa.float64()),
        ("update_norm", pa.float64()),
        ("update_ratio", pa.float64()),
        ("lr", pa.float64()),
    ])
    nodes = pa.schema([  # rows in graph order (a node's id is f"{op}:{row index within its backward}")
        ("grad_norm", pa.float32()),  # L2 of the gradient leaving the node; null if the node did not run
        ("max_abs", pa.float32()),  # max |value| of that gradient (NaN if it holds a NaN)
        ("nonfinite", pa.int64()),  # how many of its values are NaN or ±inf
        ("time_s", pa.float32()),  # the node's backward wall time
        # version 2: the smallest and the largest value of that gradient, signed (NaN if it holds a NaN)
        *([("min", pa.float32()), ("max", pa.float32())] if version >= 2 else []),
    ])
    return {"steps": steps, "parameters": parameters, "nodes": nodes}


@dataclass(frozen=True)
class Parameter:
    grad_norm: float | None  # L2 of .grad as the optimizer saw it (unscaled)
    weight_norm: float  # L2 of the weight before the step
    update_norm: float | None  # L2 of (weight after - weight before); null where no optimizer stepped
    update_ratio: float | None  # update_norm / weight_norm
    lr: float | None


@dataclass(frozen=True)
class Step:
    step: int
    loss: float | None
    skipped: bool
    scale: float | None
    peak_bytes: int | None
    peak_source: str
    lr: float | None
    lrs: list[float]
    time_s: float | None
    grad_norm: float | None
    backward_graphs: list[str]
    backward_nodes: list[int]
    micro_losses: list[float]
    micro_grad_norms: list[float]
    parameters: dict[str, Parameter] = field(repr=False)


def _read_json(path: Path, limit: int, what: str, missing_ok: bool = False) -> Any:
    """The JSON object in `path`, read only from a plain file (not a symlink, device, FIFO or socket: /dev/zero says
    its size is 0 and never ends, a FIFO never answers) and never more than `limit` bytes of it, whatever its size
    says. None for a missing file when `missing_ok`."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        if os.path.islink(path):  # O_NOFOLLOW refuses a symlink too; this says so where it is missing
            raise RecordingError(f"{path} is not a plain file, so it is not a {what} of a recording.")
        fd = os.open(path, flags)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise RecordingError(f"{path} is missing: this is not a complete recording folder ({what}).") from None
    except OSError:  # ELOOP: a symlink; ENXIO: a socket; EACCES and the rest: it cannot be read either way
        raise RecordingError(f"{path} is not a plain file that can be read, so it is not a {what} of a "
                             f"recording.") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, a device, a FIFO
            raise RecordingError(f"{path} is not a plain file, so it is not a {what} of a recording.")
        with os.fdopen(fd, "rb") as f:
            fd = None
            raw = f.read(limit + 1)
    except OSError:
        raise RecordingError(f"{path} cannot be read, so it is not a {what} of a recording.") from None
    finally:
        if fd is not None:
            os.close(fd)
    if len(raw) > limit:
        raise RecordingError(f"{path} is more than the {limit:,} bytes a {what} may be.")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise RecordingError(f"{path} is not JSON, so it is not a {what} of a recording.") from None
    except ValueError:  # a number of more than 4,300 digits (Python's limit on reading one)
        raise RecordingError(f"{path} holds a number longer than any a {what} has, so it is damaged.") from None
    if not isinstance(data, dict):
        kind = {type(None): "null", list: "a list", str: "a string", bool: "true or false"}.get(type(data), "a number")
        raise RecordingError(f"{path} holds {kind}, not the object a {what} is.")
    return data


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def json_number(value):
    """A figure as JSON can hold it: NaN and infinities by their names (`nan`, `inf`, `-inf`, as the graph export
    writes them); any other value (a finite number, None) as it is."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class Recording:
    """An opened recording (see the module docstring). Steps are read once per rank and kept."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            if self.path.exists():
                raise RecordingError(f"{self.path} is a file; a recording is a folder (with {MANIFEST} in it).")
            raise RecordingError(f"{self.path} does not exist.")
        self.manifest = _read_json(self.path / MANIFEST, MAX_JSON_BYTES, "recording manifest")
        if self.manifest.get("format") != FORMAT:
            raise RecordingError(f"{self.path / MANIFEST} does not say it is a {FORMAT}.")
        version = self.manifest.get("format_version")
        if type(version) is not int or version not in READS:
            raise RecordingError(f"{self.path} is a recording of format version {version!r}; this version of "
                                 f"graphviz-core reads versions {', '.join(map(str, READS))}.")
        self.version = version
        self.eager = self.manifest.get("eager") is True  # recorded with record(eager=True): compiled code ran eagerly
        if self.manifest.get("schema") != SCHEMA_VERSION:
            raise RecordingError(f"{self.path}'s graphs are of schema {self.manifest.get('schema')!r}; this version "
                                 f"reads schema {SCHEMA_VERSION}.")
        self.ranks = self._rank_folders()
        statuses = [self._status(rank) for rank in self.ranks]
        self.complete = all(status.get("complete") is True for status in statuses)
        self._claimed = {rank: status.get("steps") for rank, status in zip(self.ranks, statuses, strict=True)}
        self._steps: dict[int, list[Step]] = {}
        self._nodes: dict[int, Any] = {}
        self._graphs: dict[str, nx.DiGraph] = {}

    def _rank_folders(self) -> list[int]:
        """The ranks of the rank-<n> folders (not symlinks), each named as the writer names it; more than MAX_RANKS of
        them, or a folder of more than MAX_FOLDER_ENTRIES entries, is one sentence."""
        ranks = []
        try:
            with os.scandir(self.path) as entries:
                for seen, entry in enumerate(entries):
                    if seen >= MAX_FOLDER_ENTRIES:
                        raise RecordingError(f"{self.path} holds more than {MAX_FOLDER_ENTRIES:,} entries; a recording "
                                             f"folder holds its manifest, graphs and rank folders.")
                    match = RANK_DIR.match(entry.name)
                    if match and entry.is_dir(follow_symlinks=False):
                        ranks.append(int(match.group(1)))
                        if len(ranks) > MAX_RANKS:
                            raise RecordingError(f"{self.path} holds more than {MAX_RANKS:,} rank folders, more than "
                                                 f"this reader opens.")
        except OSError as exc:
            raise RecordingError(f"{self.path} cannot be listed: {exc.strerror or exc}.") from None
        if not ranks:
            raise RecordingError(f"{self.path} holds no rank-<n> folder: the run recorded no step.")
        return sorted(ranks)

    def _status(self, rank: int) -> dict:
        path = self.path / f"rank-{rank}" / STATUS
        status = _read_json(path, MAX_JSON_BYTES, "rank status", missing_ok=True)
        if status is None:
            return {}
        complete, steps = status.get("complete"), status.get("steps")
        if type(complete) is not bool or type(steps) is not int or steps < 0:
            raise RecordingError(f"{path} does not hold a yes-or-no `complete` and a whole number of `steps` from 0.")
        return status

    def _stream(self, rank: int, name: str) -> list:
        """The complete record batches of one stream (a partial batch at the end, from a killed run, is dropped)."""
        import pyarrow as pa

        path = self.path / f"rank-{rank}" / f"{name}.arrows"
        if path.is_symlink() or (path.exists() and not path.is_file()):  # a symlink, even to nothing, is refused
            raise RecordingError(f"{path} is not a plain file.")
        if not path.exists():
            return []
        size = path.stat().st_size
        if size > MAX_STREAM_BYTES:
            raise RecordingError(f"{path} is {size:,} bytes, more than the {MAX_STREAM_BYTES:,} a stream may be.")
        if size == 0:
            return []
        expected = arrow_schemas(self.version)[name]
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        except (pa.ArrowException, OSError):
            raise RecordingError(f"{path} is not an Arrow stream; it is not part of a recording (or is damaged at its "
                                 f"start).") from None
        if not reader.schema.equals(expected):
            raise RecordingError(f"{path}'s columns are not those of a version-{self.version} recording's {name}.")
        batches = []
        while True:
            try:
                batch = reader.read_next_batch()
                batch.validate(full=True)
            except StopIteration:
                break
            except (pa.ArrowException, OSError, ValueError):
                break  # a batch cut short by a killed run, or damaged: the steps before it stand
            batches.append(batch)
        return batches

    def steps(self, rank: int = 0) -> list[Step]:
        """Every complete step of `rank`, in order."""
        if rank not in self.ranks:
            raise RecordingError(f"{self.path} has no rank {rank}; its ranks are {', '.join(map(str, self.ranks))}.")
        if rank in self._steps:
            return self._steps[rank]
        folder = self.path / f"rank-{rank}"
        rows = [row for batch in self._stream(rank, "steps") for row in batch.to_pylist()]
        claimed = self._claimed.get(rank)
        if claimed is not None and claimed < len(rows):
            raise RecordingError(f"{folder / STATUS} says the run recorded {claimed} steps, but steps.arrows holds "
                                 f"{len(rows)}; the recording is damaged.")
        # The writer writes one batch per step to each stream, a step's parameters before its steps row: a steps row
        # without its parameters batch is past a cut in parameters.arrows, and, as with a cut steps.arrows, only the
        # steps before the cut stand.
        parameter_batches = self._stream(rank, "parameters")
        steps = []
        for row, batch in zip(rows, parameter_batches, strict=False):
            number = row["step"]
            if number is None or number <= (steps[-1].step if steps else -1):
                after = f"after step {steps[-1].step}" if steps else "first"
                raise RecordingError(f"{folder / 'steps.arrows'} has step {number} {after}; steps are numbered from 0 "
                                     f"up, each once, so the recording is damaged.")
            if row["skipped"] is None:
                raise RecordingError(f"{folder / 'steps.arrows'}'s step {number} has no `skipped`; the recording is "
                                     f"damaged.")
            _not_negative(folder / "steps.arrows", number, row, ("grad_norm", "time_s"))
            if row["peak_bytes"] is not None and row["peak_bytes"] < 0:  # a model over several GPUs, recorded before
                row["peak_bytes"] = None  # the recorder left out only its own copies on the peak's device: not known
            if any(v is not None and v < 0 for v in row["micro_grad_norms"] or []):
                raise RecordingError(f"{folder / 'steps.arrows'}'s step {number} has a negative micro_grad_norms "
                                     f"value; a norm never is, so the recording is damaged.")
            counts = row["backward_nodes"] or []
            graphs = row["backward_graphs"] or []
            if len(counts) != len(graphs) or any(not GRAPH_ID.match(g or "") for g in graphs) or any(
                    c is None or not 0 <= c <= MAX_GRAPH_NODES for c in counts):
                raise RecordingError(f"{self.path}'s rank {rank} step {number} names its graphs wrongly; the "
                                     f"recording is damaged.")
            parameters = {}
            for parameter in batch.to_pylist():
                name = parameter["name"]
                if parameter["step"] != number:
                    raise RecordingError(f"{folder / 'parameters.arrows'} holds a row of step {parameter['step']} "
                                         f"among step {number}'s; the recording is damaged.")
                if not isinstance(name, str) or not name:
                    raise RecordingError(f"{folder / 'parameters.arrows'} has a parameter of step {number} without a "
                                         f"name; the recording is damaged.")
                if name in parameters:  # two loose top-level modules, recorded without model=: both have "weight"
                    name = next(f"{name}#{n}" for n in range(2, len(parameters) + 3) if f"{name}#{n}" not in parameters)
                _not_negative(folder / "parameters.arrows", number, parameter,
                              ("grad_norm", "weight_norm", "update_norm", "update_ratio"))
                parameters[name] = Parameter(parameter["grad_norm"], parameter["weight_norm"],
                                             parameter["update_norm"], parameter["update_ratio"], parameter["lr"])
            steps.append(Step(number, _finite(row["loss"]), row["skipped"], row["scale"], row["peak_bytes"],
                              row["peak_source"] or "", row["lr"], row["lrs"] or [], row["time_s"], row["grad_norm"],
                              graphs, counts, row["micro_losses"] or [], row["micro_grad_norms"] or [], parameters))
        self._steps[rank] = steps
        return steps

    def graph(self, graph_id: str) -> nx.DiGraph:
        """A distinct graph of the run, its nodes in graph/schema.py's records (the first backward that ran it
        filled its saved bytes and FLOPs)."""
        if not isinstance(graph_id, str) or not GRAPH_ID.match(graph_id):
            raise RecordingError(f"{graph_id!r} is not a graph id of a recording.")
        if graph_id in self._graphs:
            return self._graphs[graph_id]
        folder = self.path / GRAPHS
        if folder.is_symlink():
            raise RecordingError(f"{folder} is a symlink; a recording's graphs are in a folder of its own.")
        data = _read_json(folder / f"{graph_id}.json", MAX_GRAPH_BYTES, "recorded graph")
        nodes, links = data.get("nodes"), data.get("links")
        if not isinstance(nodes, list) or not isinstance(links, list) or len(nodes) > MAX_GRAPH_NODES:
            raise RecordingError(f"graph {graph_id} of {self.path} has no node and link lists of a usable size.")
        graph = nx.DiGraph()
        try:
            for node in nodes:
                node_id = node.get("id") if isinstance(node, dict) else None
                if not isinstance(node_id, str):
                    raise RecordingError(f"graph {graph_id} of {self.path} has a node without an id.")
                if node_id in graph:
                    raise RecordingError(f"graph {graph_id} of {self.path} has two nodes with the id {node_id[:80]!r}.")
                graph.add_node(node_id, **NodeRecord.from_dict(node, node_id).to_dict())
            for index, link in enumerate(links):
                source, target = (link.get("source"), link.get("target")) if isinstance(link, dict) else (None, None)
                if source not in graph or target not in graph:
                    raise RecordingError(f"graph {graph_id} of {self.path} has an edge between nodes it lacks.")
                # `links`: the edge's places in the file's list (each one gradient, its shape in the debug log): a
                # node may send two gradients to one node (x.split(...) into one mm)
                if graph.has_edge(source, target):
                    graph.edges[source, target]["links"].append(index)
                else:
                    graph.add_edge(source, target, links=[index])
        except RecordingError:
            raise
        except ValueError as exc:
            raise RecordingError(f"graph {graph_id} of {self.path}: {exc}") from None
        if not nx.is_directed_acyclic_graph(graph):
            raise RecordingError(f"graph {graph_id} of {self.path} has a cycle (an edge back to a node before it, or "
                                 f"to itself); an autograd graph has none, so the file is damaged.")
        self._graphs[graph_id] = graph
        return graph

    def node_figures(self, rank: int = 0) -> list:
        """Per complete step, per backward: the NODES rows (a pyarrow RecordBatch) of that backward."""
        if rank in self._nodes:
            return self._nodes[rank]
        steps = self.steps(rank)
        batches = self._stream(rank, "nodes")
        if len(batches) < len(steps):
            raise RecordingError(f"{self.path}'s rank {rank} has figures for {len(batches)} steps but records "
                                 f"{len(steps)}; the recording is damaged.")
        import pyarrow.compute as pc

        out = []
        for step, batch in zip(steps, batches, strict=False):
            if batch.num_rows != sum(step.backward_nodes):
                raise RecordingError(f"{self.path}'s rank {rank} step {step.step} has {batch.num_rows} node rows, not "
                                     f"the {sum(step.backward_nodes)} its backwards ran.")
            for graph_id, count in zip(step.backward_graphs, step.backward_nodes, strict=True):
                nodes = self.graph(graph_id).number_of_nodes()  # a graph that is missing or damaged: one sentence
                if count != nodes:
                    raise RecordingError(f"{self.path}'s rank {rank} step {step.step} has {count} node rows for graph "
                                         f"{graph_id}, which has {nodes} nodes; the recording is damaged.")
            for name in ("grad_norm", "max_abs", "nonfinite", "time_s"):  # NaN and null compare as not below 0
                if pc.any(pc.less(batch.column(name), 0)).as_py():
                    raise RecordingError(f"{self.path / f'rank-{rank}' / 'nodes.arrows'} gives a node of step "
                                         f"{step.step} a negative {name}, which it cannot have; the recording is "
                                         f"damaged.")
            offsets = [0]
            for count in step.backward_nodes:
                offsets.append(offsets[-1] + count)
            out.append([batch.slice(a, b - a) for a, b in zip(offsets, offsets[1:], strict=False)])
        self._nodes[rank] = out
        return out

    def step_graph(self, step: int, rank: int = 0, backward: int = 0) -> nx.DiGraph:
        """The graph of one backward of one step, each node carrying that backward's figures: `grad_norm` and
        `time_s` replaced by the recorded ones, `max_abs`, `nonfinite`, `min` and `max` added (null where the node did
        not run; `min` and `max` null in a version-1 recording)."""
        steps = self.steps(rank)
        index = next((i for i, s in enumerate(steps) if s.step == step), None)
        if index is None:
            raise RecordingError(f"{self.path} has no complete step {step} on rank {rank}.")
        record = steps[index]
        if not 0 <= backward < len(record.backward_graphs):
            raise RecordingError(f"step {step} ran {len(record.backward_graphs)} backward(s); there is no "
                                 f"backward {backward}.")
        graph = self.graph(record.backward_graphs[backward]).copy()
        figures = self.node_figures(rank)[index][backward]
        if figures.num_rows != graph.number_of_nodes():
            raise RecordingError(f"step {step}'s backward {backward} has {figures.num_rows} rows for a graph of "
                                 f"{graph.number_of_nodes()} nodes; the recording is damaged.")
        columns = {name: figures.column(name).to_pylist() for name in figures.schema.names}
        for row, node_id in enumerate(graph.nodes):
            data = graph.nodes[node_id]
            data["grad_norm"] = columns["grad_norm"][row]
            data["time_s"] = columns["time_s"][row]
            data["max_abs"] = columns["max_abs"][row]
            data["nonfinite"] = columns["nonfinite"][row]
            data["min"] = columns["min"][row] if "min" in columns else None  # a version-1 recording has no min / max
            data["max"] = columns["max"][row] if "max" in columns else None
        return graph

    def to_dict(self) -> dict:
        """The `graphviz-core recording PATH --format json` object (docs/recording.md)."""
        steps = {rank: self.steps(rank) for rank in self.ranks}
        for rank in self.ranks:
            self.node_figures(rank)  # the per-node figures are there and agree with the steps (else one sentence)
        shown = [_step_dict(s) for s in steps[self.ranks[0]]]
        return {
            "format": FORMAT,
            "format_version": self.version,  # the recording's own, which may be older than what the recorder writes
            "schema": SCHEMA_VERSION,
            "complete": self.complete,
            "eager": self.eager,
            "ranks": self.ranks,
            "created": self.manifest.get("created"),
            "torch": self.manifest.get("torch"),
            "graphs": [{"id": g, "nodes": self.graph(g).number_of_nodes(), "edges": self.graph(g).number_of_edges()}
                       for g in sorted({g for rank_steps in steps.values() for s in rank_steps
                                        for g in s.backward_graphs})],
            "steps": shown,
            **({"steps_by_rank": {str(r): [_step_dict(s) for s in steps[r]] for r in self.ranks[1:]}}
               if len(self.ranks) > 1 else {}),
        }


def _not_negative(path: Path, step: int, row: dict, keys) -> None:
    """One sentence when a figure that cannot be negative (a norm, a byte count, a time) is (NaN and null pass)."""
    for key in keys:
        value = row[key]
        if value is not None and value < 0:
            raise RecordingError(f"{path} gives step {step} a negative {key} ({value}), which it cannot have; the "
                                 f"recording is damaged.")


def _step_dict(step: Step) -> dict:
    return {
        "step": step.step,
        "loss": step.loss,
        "skipped": step.skipped,
        "scale": step.scale,
        "peak_bytes": step.peak_bytes,
        "peak_source": step.peak_source,
        "lr": json_number(step.lr),
        "time_s": step.time_s,
        "grad_norm": json_number(step.grad_norm),
        "backwards": [{"graph": g, "nodes": n} for g, n in zip(step.backward_graphs, step.backward_nodes, strict=True)],
        "micro_losses": [json_number(v) for v in step.micro_losses],
        "micro_grad_norms": [json_number(v) for v in step.micro_grad_norms],
        "parameters": {name: {"grad_norm": json_number(p.grad_norm), "weight_norm": json_number(p.weight_norm),
                              "update_norm": json_number(p.update_norm), "update_ratio": json_number(p.update_ratio)}
                       for name, p in step.parameters.items()},
    }


def open_recording(path: str | os.PathLike) -> Recording:
    """Open a recording folder; RecordingError with one sentence when it cannot be read."""
    try:
        return Recording(path)
    except RecordingError:
        raise
    except (OSError, ValueError) as exc:
        raise RecordingError(f"{path} cannot be read as a recording: {str(exc).splitlines()[0] if str(exc) else exc}") \
            from None
