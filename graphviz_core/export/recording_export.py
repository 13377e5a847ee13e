"""A recording (graph/recording.py) written where people already look: TensorBoard event files and a Chrome trace.

    to_tensorboard(recording, "runs/exp1-tb")     # event files: scalars and histograms, one run per rank
    trace = to_chrome_trace(recording)            # a dict; json.dump it: Perfetto and chrome://tracing open it

TensorBoard, per step (`global_step` = the recorded step):
  scalars    `loss`, `grad_norm` (the whole gradient's L2), `lr`, `peak_bytes`, `step_time_s`, `skipped` (1 where the
             GradScaler skipped the step), `scale` (with a GradScaler), `nonfinite/parameter_gradients` and
             `nonfinite/node_gradients` (how many parameters / nodes had a NaN or ±inf gradient), and per parameter
             `grad_norm/<name>`, `weight_norm/<name>`, `update_ratio/<name>`;
  histograms `parameters/grad_norm`, `parameters/update_ratio` (one value per parameter tensor), `nodes/grad_norm`,
             `nodes/time_s` (one value per autograd node of every backward of the step).
A histogram holds finite values only (TensorBoard's bins cannot hold NaN); the `nonfinite/...` scalars count the rest,
and a non-finite scalar is written as it is (TensorBoard stores NaN and ±inf; its charts leave them out).

Chrome trace (the Trace Event Format's JSON object form, which Perfetto and chrome://tracing open):
one process per rank; on the thread "steps" one complete event ("ph": "X") per step, `time_s` long, steps end to end
from 0; on the thread "backward nodes" one event per autograd node that ran, its recorded backward time long, named by
its op, with its module, category, gradient norm, max |value| and non-finite count in `args`. The recorder keeps each
node's duration, not its start: a step's nodes are laid end to end from the step's start, each backward after the one
before, in an order autograd could have run them (every node after the nodes that send it its gradient).
`otherData` says so in the file too.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import networkx as nx

from graphviz_core.graph.recording import Recording, RecordingError, json_number

TRACE_NOTE = ("Node start times are laid out, not measured: the recorder keeps each node's backward duration; a "
              "step's nodes are placed end to end from the step's start in an order autograd could have run them.")


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def _nonfinite(values) -> int:
    return sum(1 for v in values if v is not None and not math.isfinite(v))


def to_tensorboard(recording: Recording, folder: str | os.PathLike) -> list[Path]:
    """Write the recording's steps as TensorBoard event files under `folder` (a run per rank: the folder itself for
    one rank, `rank-<r>/` inside it for several); the event files written."""
    import numpy as np

    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise RecordingError("TensorBoard export needs the tensorboard package: pip install tensorboard.") from None
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise RecordingError(f"{folder} is a file; give a folder for the TensorBoard event files.")
    # every rank's steps and node figures are read, and checked against their graphs (a graph file that is missing
    # or damaged is one sentence), before any event file is written
    read = {rank: (recording.steps(rank), recording.node_figures(rank)) for rank in recording.ranks}
    written = []
    for rank, (steps, figures) in read.items():
        run = folder if len(recording.ranks) == 1 else folder / f"rank-{rank}"
        try:
            writer = SummaryWriter(log_dir=str(run))
        except OSError as exc:
            raise RecordingError(f"cannot write TensorBoard files in {run}: {exc.strerror or exc}.") from None
        try:
            for step, backwards in zip(steps, figures, strict=True):
                _tensorboard_step(writer, step, backwards, np)
        finally:
            writer.close()
        written += sorted(run.glob("events.out.tfevents.*"))
    return written


def _tensorboard_step(writer, step, backwards, np) -> None:
    at = step.step
    scalars = {"loss": step.loss, "grad_norm": step.grad_norm, "lr": step.lr, "peak_bytes": step.peak_bytes,
               "step_time_s": step.time_s, "skipped": float(step.skipped), "scale": step.scale}
    grads = [p.grad_norm for p in step.parameters.values()]
    node_grads = [v for batch in backwards for v in batch.column("grad_norm").to_pylist()]
    node_times = [v for batch in backwards for v in batch.column("time_s").to_pylist()]
    scalars["nonfinite/parameter_gradients"] = _nonfinite(grads)
    scalars["nonfinite/node_gradients"] = _nonfinite(node_grads)
    for name, value in scalars.items():
        if value is not None:
            writer.add_scalar(name, float(value), at)
    for name, p in step.parameters.items():
        for key in ("grad_norm", "weight_norm", "update_ratio"):
            value = getattr(p, key)
            if value is not None:
                writer.add_scalar(f"{key}/{name}", float(value), at)
    histograms = {"parameters/grad_norm": grads,
                  "parameters/update_ratio": [p.update_ratio for p in step.parameters.values()],
                  "nodes/grad_norm": node_grads, "nodes/time_s": node_times}
    for tag, values in histograms.items():
        finite = _finite(values)
        if finite:
            writer.add_histogram(tag, np.asarray(finite, dtype=np.float64), at)


def run_order(graph: nx.DiGraph) -> list[str]:
    """The graph's nodes in an order autograd could run them: each after every node with an edge into it (the nodes
    that send it its gradient), ties in the graph's own order (pre-order from the loss)."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    return list(nx.lexicographical_topological_sort(graph, key=position.__getitem__))


def to_chrome_trace(recording: Recording) -> dict:
    """The recording's steps and per-node backward times as a Chrome trace (Trace Event Format, JSON object form)."""
    events: list[dict] = []
    for rank in recording.ranks:
        events += [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
                   {"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "steps"}},
                   {"ph": "M", "name": "thread_name", "pid": rank, "tid": 1, "args": {"name": "backward nodes"}}]
        start_us = 0.0
        for step, backwards in zip(recording.steps(rank), recording.node_figures(rank), strict=True):
            step_us = max(0.0, (step.time_s or 0.0) * 1e6)
            events.append({"ph": "X", "name": f"step {step.step}", "cat": "step", "pid": rank, "tid": 0,
                           "ts": round(start_us, 3), "dur": round(step_us, 3),
                           "args": {"loss": json_number(step.loss), "grad_norm": json_number(step.grad_norm),
                                    "skipped": step.skipped, "backwards": len(backwards)}})
            at = start_us
            for index, (graph_id, batch) in enumerate(zip(step.backward_graphs, backwards, strict=True)):
                graph = recording.graph(graph_id)
                columns = {name: batch.column(name).to_pylist() for name in batch.schema.names}
                row_of = {node: row for row, node in enumerate(graph.nodes)}
                for node in run_order(graph):
                    row = row_of[node]
                    seconds = columns["time_s"][row]
                    if seconds is None:
                        continue  # the node did not run in this backward
                    data = graph.nodes[node]
                    dur = max(0.0, float(seconds) * 1e6)
                    events.append({"ph": "X", "name": data["op"], "cat": data["category"], "pid": rank, "tid": 1,
                                   "ts": round(at, 3), "dur": round(dur, 3),
                                   "args": {"node": node, "module": data["module"], "step": step.step,
                                            "backward": index, "grad_norm": json_number(columns["grad_norm"][row]),
                                            "max_abs": json_number(columns["max_abs"][row]),
                                            "nonfinite": columns["nonfinite"][row]}})
                    at += dur
            start_us += step_us
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "graphviz-core recording", "note": TRACE_NOTE}}

