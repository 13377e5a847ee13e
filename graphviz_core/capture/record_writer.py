"""Writes a recording as the run goes (the format: graphviz_core.graph.recording, docs/recording.md).

Every step is one record batch appended to each of three Arrow IPC streams per rank, the steps stream last, each
written straight to the file (no buffer of ours): a run killed with SIGKILL leaves every completed step readable.
JSON files (the manifest, each distinct graph, the rank's status) are written to a temporary name and renamed, so
they are whole or absent. No pickle: Arrow and JSON only.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from graphviz_core.graph.recording import FORMAT, FORMAT_VERSION, GRAPHS, MANIFEST, STATUS, arrow_schemas
from graphviz_core.graph.schema import SCHEMA_VERSION


def _write_json(path: Path, data: dict) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, allow_nan=False, separators=(",", ":")), encoding="utf-8")
    os.replace(temporary, path)


def _rank_now() -> int | None:
    """This process's rank when it is one of several (torch.distributed initialised, or torchrun's RANK set)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK", "")
    return int(rank) if rank.isdigit() else None


def _holds_anything(folder: Path) -> bool:
    with os.scandir(folder) as entries:
        return next(entries, None) is not None


class RecordingWriter:
    """One recording folder; `rank` streams opened at the first step (a DDP script initialises its process group
    after the recorder starts)."""

    def __init__(self, path: str | os.PathLike, steps_limit: int | None, eager: bool = False) -> None:
        import torch

        if not os.fspath(path).strip():  # Path('') is the current folder
            raise ValueError("record() was given '' for its folder; name the folder to write the recording in.")
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"{self.path} is a file; give record() a folder to write the recording in.")
        rank = _rank_now()
        if rank is None and (self.path / MANIFEST).exists():
            raise ValueError(f"{self.path} already holds a recording; choose a new folder (nothing is overwritten).")
        if rank is None and self.path.is_dir() and _holds_anything(self.path):
            # a folder of the user's own (logs, a stream named like ours) would have files replaced or appended to
            raise ValueError(f"{self.path} is not empty; choose a new or empty folder (nothing is overwritten).")
        if rank is not None and (self.path / f"rank-{rank}").exists():  # ranks share the folder, each its own part
            raise ValueError(f"{self.path} already holds rank {rank}'s recording; choose a new folder (nothing is "
                             f"overwritten).")
        try:
            (self.path / GRAPHS).mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file on the way (script.py/run), a folder it may not write in (/sys/run)
            raise ValueError(f"cannot write the recording in {self.path}: {exc.strerror or exc}.") from None
        self.manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "schema": SCHEMA_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "steps_limit": steps_limit, "eager": eager,
        }
        if not (self.path / MANIFEST).exists():
            _write_json(self.path / MANIFEST, self.manifest)
        self.graphs: set[str] = {p.stem for p in (self.path / GRAPHS).glob("*.json")}
        self.rank: int | None = None
        self.streams: dict = {}
        self.steps = 0

    def open_rank(self, rank: int) -> None:
        import pyarrow as pa

        self.rank = rank
        folder = self.path / f"rank-{rank}"
        folder.mkdir(exist_ok=True)
        self.folder = folder
        for name, schema in arrow_schemas().items():
            sink = pa.OSFile(str(folder / f"{name}.arrows"), "wb")
            self.streams[name] = (sink, pa.ipc.new_stream(sink, schema))

    def write_graph(self, graph_id: str, node_link: dict) -> None:
        if graph_id in self.graphs:
            return
        _write_json(self.path / GRAPHS / f"{graph_id}.json", node_link)
        self.graphs.add(graph_id)

    def write_step(self, step: dict, parameters: dict, nodes: dict) -> None:
        """One complete step: its parameters' rows, its nodes' rows, then its steps row (a step is complete when
        that row is in the file)."""
        import pyarrow as pa

        schemas = arrow_schemas()
        for name, columns in (("parameters", parameters), ("nodes", nodes), ("steps", {k: [v] for k, v in step.items()})):
            batch = pa.RecordBatch.from_arrays([arrow_array(columns[f.name], f.type) for f in schemas[name]],
                                               schema=schemas[name])
            self.streams[name][1].write_batch(batch)
        self.steps += 1

    def close(self, complete: bool) -> None:
        for sink, writer in self.streams.values():
            writer.close()
            sink.close()
        self.streams = {}
        if self.rank is not None:
            _write_json(self.folder / STATUS, {"complete": complete, "steps": self.steps})


def arrow_array(values: list, kind):
    """An Arrow array of `values` (None for null) built from its buffers. `pyarrow.array` imports pandas on its first
    call (to ask whether the values are a pandas object): 47 MB of the training process's memory for a recording
    that never uses it. Takes the types arrow_schemas uses: integers, floats, booleans, strings, lists of those."""
    import numpy as np
    import pyarrow as pa

    count = len(values)
    present = np.fromiter((v is not None for v in values), dtype=bool, count=count)
    nulls = count - int(present.sum())
    validity = pa.py_buffer(np.packbits(present, bitorder="little")) if nulls else None
    if pa.types.is_list(kind):
        items = [v if v is not None else [] for v in values]
        offsets = np.zeros(count + 1, dtype=np.int32)
        np.cumsum([len(v) for v in items], out=offsets[1:])
        child = arrow_array([x for v in items for x in v], kind.value_type)
        return pa.Array.from_buffers(kind, count, [validity, pa.py_buffer(offsets)], null_count=nulls,
                                     children=[child])
    if pa.types.is_string(kind):
        encoded = [(v if v is not None else "").encode() for v in values]
        offsets = np.zeros(count + 1, dtype=np.int32)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        return pa.Array.from_buffers(kind, count, [validity, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))],
                                     null_count=nulls)
    if pa.types.is_boolean(kind):
        bits = np.fromiter((bool(v) for v in values), dtype=bool, count=count)
        return pa.Array.from_buffers(kind, count, [validity, pa.py_buffer(np.packbits(bits, bitorder="little"))],
                                     null_count=nulls)
    numbers = {pa.int32(): np.int32, pa.int64(): np.int64, pa.float32(): np.float32, pa.float64(): np.float64}
    with np.errstate(over="ignore"):  # a float beyond float32's range is stored as inf, as torch casts it
        data = np.array([0 if v is None else v for v in values], dtype=numbers[kind])
    return pa.Array.from_buffers(kind, count, [validity, pa.py_buffer(data)], null_count=nulls)
