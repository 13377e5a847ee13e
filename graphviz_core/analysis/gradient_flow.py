"""Gradient-flow debugging over a recording (issue 36; docs/debugging.md): where a non-finite value started, what
never got a gradient and why, dead units, vanishing and exploding gradients, the scaler's skipped steps, and the
gradient noise scale. Pure functions of what the recorder wrote (graph.recording and the debug lines of
capture.nonfinite); `graphviz-core debug` prints them, for a recording or for one step of a preset (recorded first).

Each finding is a dict with `kind` (one of KINDS) and, where they apply, `step`, `rank`, `node` (the autograd op),
`module`, `source` (`file:line`), `parameter`, `reason`, `fraction`, and `figures`.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import tempfile
from dataclasses import dataclass, field

import networkx as nx

from graphviz_core.analysis.flop_analysis import layer_of
from graphviz_core.graph.recording import Recording, RecordingError, json_number, open_recording
from graphviz_core.units import some_of

KINDS = ("nonfinite-backward", "nonfinite-forward", "nonfinite-loss", "no-gradient", "dead-units",
         "scaler-overflow", "vanishing", "exploding")
DEBUG_FILE = "debug.jsonl"  # written by capture.nonfinite.DebugWatch
MAX_DEBUG_BYTES = 256 << 20

# The rules, stated (docs/debugging.md says the same):
DEAD_FRACTION = 0.10  # a ReLU-family layer with at least 10% of its units zero for the whole batch
EXPLODING_FACTOR = 10.0  # a step's whole-gradient norm above 10x the median of the steps before it ...
EXPLODING_WINDOW = 20  # ... (up to 20 of them, at least EXPLODING_MIN) -- Pascanu, Mikolov & Bengio (2013)
EXPLODING_MIN = 5
VANISHING_RATIO = 1e-4  # a module's gradient norm below 1e-4 of the largest module's in the same step


@dataclass
class DebugLog:
    """What capture.nonfinite wrote for one rank (empty for a recording made without it)."""

    parameters: list = field(default_factory=list)
    steps: dict = field(default_factory=dict)  # step -> its line
    sources: dict = field(default_factory=dict)  # graph id -> {row: "file:line"}
    link_shapes: dict = field(default_factory=dict)  # (graph id, key) -> (shapes, dtypes), one per edge of the graph


def read_debug(recording: Recording, rank: int) -> DebugLog:
    """rank-<r>/debug.jsonl, bounded; a last line cut short by a killed run is dropped."""
    path = recording.path / f"rank-{rank}" / DEBUG_FILE
    log = DebugLog()
    if not path.exists():
        return log
    if path.is_symlink() or not path.is_file():
        raise RecordingError(f"{path} is not a plain file.")
    if path.stat().st_size > MAX_DEBUG_BYTES:
        raise RecordingError(f"{path} is more than the {MAX_DEBUG_BYTES:,} bytes a debug log may be.")
    lines = path.read_bytes().split(b"\n")
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            if i >= len(lines) - 2:
                break  # the last line, cut short
            raise RecordingError(f"{path} line {i + 1} is not JSON; the recording's debug log is damaged.") from None
        if not isinstance(line, dict):
            raise RecordingError(f"{path} line {i + 1} is not an object; the recording's debug log is damaged.")
        if isinstance(line.get("parameters"), list):
            log.parameters = line["parameters"]
        elif isinstance(line.get("step"), int):
            log.steps[line["step"]] = _checked_step(line, f"{path} line {i + 1}")
        elif isinstance(line.get("sources"), str) and isinstance(line.get("rows"), dict):
            log.sources[line["sources"]] = {str(k): str(v) for k, v in line["rows"].items()}
        elif isinstance(line.get("link_shapes"), str):
            log.link_shapes[(line["link_shapes"], line.get("key"))] = _checked_shapes(line, f"{path} line {i + 1}")
    return log


MAX_DIMS = 64  # a tensor's dimensions, at most (torch allows 64 too)


def _shape_ok(shape) -> bool:
    """A tensor's shape as the recorder writes it: at most MAX_DIMS sizes, each a whole number in 0 .. 2**63 - 1."""
    return isinstance(shape, list) and len(shape) <= MAX_DIMS and all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2 ** 63 for d in shape)


def _value_ok(value) -> bool:
    """A saved tensor's smallest or largest value as the recorder writes it: a finite number (JSON's NaN, Infinity
    and 1e999 are read as floats: refused), `nan`, `inf` or `-inf` by name, or null."""
    if value is None or value in ("nan", "inf", "-inf"):
        return True
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond a float's range
        return False


SAVED_KEYS = ("name", "shape", "dtype", "min", "max", "nonfinite")  # of a saved tensor's figures (saved_values)


def _checked_shapes(line: dict, where: str) -> tuple[list, list]:
    """A `link_shapes` line's shapes (a list of non-negative integers, or null, per edge) and dtypes (a name or null
    each), checked as a step line is."""
    shapes, dtypes, key = line.get("shapes"), line.get("dtypes"), line.get("key")
    good = (isinstance(key, str) and isinstance(shapes, list) and isinstance(dtypes, list)
            and len(shapes) == len(dtypes) and all(s is None or _shape_ok(s) for s in shapes)
            and all(d is None or (isinstance(d, str) and len(d) <= 32) for d in dtypes))
    if not good:
        raise RecordingError(f"{where} has a field of the wrong type; the recording's debug log is damaged.")
    return shapes, dtypes


def _checked_step(line: dict, where: str) -> dict:
    """A step line with every field of the type capture.nonfinite writes (a file from someone else may hold
    anything: one sentence, never a crash on a wrong type)."""
    def text(value) -> bool:
        return value is None or isinstance(value, str)

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    missing = line.get("no_gradient") or []
    dead = line.get("dead_units") or {}
    losses = line.get("losses") or []
    forward = line.get("forward") or {}
    keys = line.get("link_shapes") or []
    saved = line.get("saved_values") or []

    def figures(v) -> bool:
        return (isinstance(v, dict) and isinstance(v.get("name"), str) and text(v.get("dtype"))
                and _shape_ok(v.get("shape")) and _value_ok(v.get("min")) and _value_ok(v.get("max"))
                and (v.get("nonfinite") is None or count(v.get("nonfinite"))))

    def cut(value) -> bool:  # where a cut output entered the graph (capture.nonfinite._cut_at)
        return value is None or (isinstance(value, dict) and count(value.get("backward")) and count(value.get("row"))
                                 and isinstance(value.get("op"), str))

    good = (isinstance(missing, list) and all(isinstance(e, dict) and all(text(e.get(k)) for k in
                                                                        ("parameter", "module", "reason"))
                                              and cut(e.get("cut")) for e in missing)
            and isinstance(dead, dict) and all(isinstance(v, list) and len(v) == 2 and all(count(n) for n in v)
                                               and v[0] <= v[1] for v in dead.values())
            and isinstance(losses, list) and all(text(v) for v in losses)
            and isinstance(forward, dict) and all(
                isinstance(v, dict) and all(text(v.get(k)) for k in ("op", "module", "source"))
                and all(count(v.get(k, 0)) for k in ("nan", "inf")) and cut(v.get("at"))
                and all(isinstance(v.get(k) or [], list) and all(_shape_ok(x) for x in v.get(k) or [])
                        for k in ("inputs", "outputs")) for v in forward.values())
            and isinstance(keys, list) and all(isinstance(k, str) for k in keys)
            and isinstance(saved, list) and all(isinstance(b, dict) and all(
                isinstance(r, list) and all(figures(v) for v in r) for r in b.values()) for b in saved))
    if not good:
        raise RecordingError(f"{where} has a field of the wrong type; the recording's debug log is damaged.")
    return line


def noise_scale(micro_grad_norms: list[float], grad_norm: float | None) -> float | None:
    """B_simple, in micro-batches, from k >= 2 micro-batch gradients g_i and their sum G = sum g_i ("An Empirical
    Model of Large-Batch Training", McCandlish et al. 2018, appendix A.1, with B_small = 1 and B_big = k micro-batches):
    |G_small|^2 = mean |g_i|^2, |G_big|^2 = |G / k|^2, S = (|G_small|^2 - |G_big|^2) / (1 - 1/k),
    |G|^2 = (k |G_big|^2 - |G_small|^2) / (k - 1), B_simple = S / |G|^2. A uniform scale on every g_i (a loss divided
    by k) cancels. None with fewer than two micro-batches or a non-finite norm."""
    k = len(micro_grad_norms)
    if k < 2 or grad_norm is None or not all(math.isfinite(v) for v in [*micro_grad_norms, grad_norm]):
        return None
    small = sum(v * v for v in micro_grad_norms) / k
    big = (grad_norm / k) ** 2
    true_sq = (k * big - small) / (k - 1)
    noise = (small - big) / (1 - 1 / k)
    return noise / true_sq if true_sq != 0 else None


def _first_source(graph: nx.DiGraph) -> tuple[str | None, list[str]]:
    """The first node, in an order autograd can run them (every node after the nodes that send it a gradient, ties by
    the graph's order), that receives only finite gradients and returns a non-finite one; and the others like it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    sources = []
    for node in nx.lexicographical_topological_sort(graph, key=order.get):
        data = graph.nodes[node]
        if not data.get("nonfinite"):
            continue
        if all(not graph.nodes[p].get("nonfinite") for p in graph.predecessors(node)):
            sources.append(node)
    return (sources[0] if sources else None), sources[1:]


def path_from_loss(graph: nx.DiGraph, node: str) -> list[str]:
    """The nodes a gradient passes from the loss (a node no other sends a gradient to) down to `node`, both ends in;
    the shortest such path. [node] alone where no root reaches it."""
    roots = [n for n in graph.nodes if graph.in_degree(n) == 0]
    paths = [nx.shortest_path(graph, r, node) for r in roots if r == node or nx.has_path(graph, r, node)]
    return min(paths, key=len) if paths else [node]


def _node_finding(graph, node, log: DebugLog, graph_id: str, shapes: tuple[list, list] | None = None,
                  saved: list | None = None) -> dict:
    """A non-finite node's finding: where it is, and the figures of the gradients in and out of it. `shapes`: the
    step's (shapes, dtypes) per edge of the graph (None where not recorded: each shape is then null); `saved`: the
    values of the tensors saved for it, where the recorder read them (capture.record_hooks.saved_values)."""
    data = graph.nodes[node]
    row = node.rpartition(":")[2]
    max_abs = data.get("max_abs")
    values = "nan" if max_abs is not None and max_abs != max_abs else "inf"

    def carried(source, target) -> list[dict]:  # each gradient the edge source -> target carries: shape and dtype
        links = graph.edges[source, target].get("links") or [None]
        return [{"shape": None, "dtype": None} if shapes is None or link is None or link >= len(shapes[0])
                else {"shape": shapes[0][link], "dtype": shapes[1][link]} for link in links]

    def named(target) -> dict:  # a gradient into a parameter's AccumulateGrad: that parameter's name
        name = (graph.nodes[target].get("param") or {}).get("name")
        return {"parameter": name} if name else {}

    def sent(source) -> int:  # how many gradients a node returned along the graph's edges (its figures cover them all)
        return sum(len(graph.edges[source, c].get("links") or [None]) for c in graph.successors(source))

    param = data.get("param") or {}
    returned = [{"to": c, **named(c), **g} for c in graph.successors(node) for g in carried(node, c)]
    if param:  # AccumulateGrad returns nothing: what it accumulates has its parameter's shape
        returned = [{"to": param.get("name") or "", "shape": param.get("shape"),
                     "dtype": carried(*next(iter(graph.in_edges(node))))[0]["dtype"] if graph.in_degree(node) else None}]
    figures = {
        "values": values, "nonfinite": data.get("nonfinite"),
        "grad_out": {"grad_norm": json_number(data.get("grad_norm")), "max_abs": json_number(max_abs),
                     "min": json_number(data.get("min")), "max": json_number(data.get("max")), "gradients": returned},
        "grad_in": [{"node": p, **g, "sender_returned": sent(p), "grad_norm": json_number(graph.nodes[p].get("grad_norm")),
                     "max_abs": json_number(graph.nodes[p].get("max_abs")), "min": json_number(graph.nodes[p].get("min")),
                     "max": json_number(graph.nodes[p].get("max")), "nonfinite": graph.nodes[p].get("nonfinite")}
                    for p in graph.predecessors(node) for g in carried(p, node)],
        "saved": saved if saved is not None else [
            {"shape": s.get("shape"), "dtype": s.get("dtype"), "min": None, "max": None, "nonfinite": None}
            for s in (data.get("saved") or [])],
    }
    finding = {"node": data.get("op"), "node_id": node, "module": data.get("module") or "",
               "source": log.sources.get(graph_id, {}).get(row), "figures": figures}
    # the parameters it sends a non-finite gradient to directly: for a compiled region (one node for many ops, no
    # module of its own) the place in the model is theirs
    hit = [(graph.nodes[c].get("param") or {}).get("name") for c in graph.successors(node)
           if graph.nodes[c].get("param") and graph.nodes[c].get("nonfinite")]
    if hit:
        figures["parameters"] = hit
        if data.get("op") == "CompiledFunctionBackward":
            finding["parameter"] = hit[0]
    if data.get("op") == "CompiledFunctionBackward":
        finding["replay"] = REPLAY
    return finding


# A finding inside a compiled region: how to see its op (the preset's step does it itself: debug_step)
REPLAY = ("a compiled region's ops are one node here; to name the op, run the same loop again under "
          "graphviz_core.record(..., eager=True) or graphviz-core record --eager: torch.compile'd code then runs "
          "eagerly (torch.compiler.set_stance(\"force_eager\"), torch 2.6 or newer), and with the same seeds and data "
          "the finding lands at its own node")


def _nonfinite(step, figure: str) -> list[str]:
    """The parameters of `step` whose `figure` ("weight_norm", "grad_norm") is NaN or infinite, by name."""
    return sorted(n for n, p in step.parameters.items()
                  if getattr(p, figure) is not None and not math.isfinite(getattr(p, figure)))


def _already_bad(step, before) -> str:
    """Why the loss of `step` was not finite, as the reason's end: the parameters that held a NaN or inf before its
    forward (an earlier update wrote them, the last step `before` whose weights were all finite, if any), or "" where
    every weight was finite (the forward made it)."""
    bad = _nonfinite(step, "weight_norm")
    if not bad:
        return ""
    by = f"by the update of step {before.step}" if before is not None else "before the first recorded step"
    return f"the weights {some_of(bad, 3)} already held a NaN or inf before this step's forward (written {by})"


def _backward_findings(recording, rank, step, index, log: DebugLog, loss_bad: bool, forward_found: bool = False,
                       weights: str = "") -> list[dict]:
    """The step's non-finite backward findings; with `loss_bad`, why the loss was not finite: `weights` (_already_bad)
    or the forward (the nonfinite-forward finding of this step, where `forward_found`)."""
    out = []
    line = log.steps.get(step.step) or {}
    keys, saved = line.get("link_shapes") or [], line.get("saved_values") or []
    for b, graph_id in enumerate(step.backward_graphs):
        graph = recording.step_graph(step.step, rank, b)
        first, others = _first_source(graph)
        if first is None:
            continue
        shapes = log.link_shapes.get((graph_id, keys[b])) if b < len(keys) else None
        values = saved[b].get(first.rpartition(":")[2]) if b < len(saved) else None
        # known keys only; none read (a compiled region frees what it saved inside its backward): the graph's shapes
        values = [{k: v.get(k) for k in SAVED_KEYS} for v in values] if values else None
        finding = _node_finding(graph, first, log, graph_id, shapes, values)
        finding["backward"] = b
        if others:
            finding["figures"]["other_sources"] = others[:20]
        if step.skipped:
            scale = step.scale if step.scale is not None else float("nan")
            finding.update(kind="scaler-overflow", reason=f"scaler overflow (scale = {scale:g}), step skipped")
        elif loss_bad:
            why = weights or ("the forward made it (see the nonfinite-loss and nonfinite-forward findings)"
                              if forward_found else "the forward made it (see the nonfinite-loss finding)")
            finding.update(kind="nonfinite-backward", reason=f"the loss was already non-finite: {why}")
        else:
            finding.update(kind="nonfinite-backward", reason=f"receives only finite gradients and returns {values_of(finding)}")
        out.append({"step": step.step, "rank": rank, **finding})
        if step.skipped:
            break  # one overflow finding per skipped step
    if step.skipped and not out:
        scale = step.scale if step.scale is not None else float("nan")
        out.append({"kind": "scaler-overflow", "step": step.step, "rank": rank,
                    "reason": f"scaler overflow (scale = {scale:g}), step skipped"})
    return out


def _unplaced_findings(rank, step, weights: str = "") -> list[dict]:
    """A step recorded without per-node figures (nodes_every, nodes=False): the parameters whose gradient held a NaN or
    inf, from the per-parameter figures every step has, where no node can be named; `weights` (_already_bad): why,
    where the weights already held one. A skipped step is the scaler's."""
    bad = _nonfinite(step, "grad_norm")
    if not bad or step.skipped:
        return []
    why = (weights if weights else "this step was recorded without per-node figures (nodes_every, or nodes=False), so "
           "the node where it started is not named: record with per-node figures on every step to find it")
    return [{"kind": "nonfinite-backward", "step": step.step, "rank": rank, "parameter": bad[0],
             "reason": f"the gradient of {some_of(bad, 3)} held a NaN or inf; {why}", "figures": {"parameters": bad[:20]}}]


def values_of(finding: dict) -> str:
    return "NaN" if finding["figures"]["values"] == "nan" else "an infinity (no NaN)"


def _forward_findings(rank, step, line: dict, loss_bad: bool) -> list[dict]:
    out = []
    losses = line.get("losses") or []
    if loss_bad:
        bad = [v for v in losses if v is not None]
        out.append({"kind": "nonfinite-loss", "step": step.step, "rank": rank,
                    "reason": f"the loss is {bad[0] if bad else 'not finite'}",
                    "figures": {"losses": [v if v is not None else "finite" for v in losses]}})
    producers = line.get("forward") or {}
    for kind in ("nan", "inf"):
        found = producers.get(kind)
        if not isinstance(found, dict) or (kind == "inf" and not loss_bad):
            continue  # an inf in the forward (a -inf mask) is a finding only when the loss is not finite
        at = found.get("at")  # the node the op made in the step's graph (capture.nonfinite), where a backward ran
        out.append({"kind": "nonfinite-forward", "step": step.step, "rank": rank, "node": found.get("op"),
                    **({"node_id": f"{at['op']}:{at['row']}", "backward": at["backward"]} if at else {}),
                    "module": found.get("module") or "", "source": found.get("source"),
                    "reason": f"the first op whose output holds {'a NaN' if kind == 'nan' else 'an inf'} while no "
                              f"input did",
                    "figures": {k: found.get(k) for k in ("nan", "inf", "inputs", "outputs")}})
    return out


def _aggregate(found: dict, key: tuple, finding: dict) -> None:
    """One finding per (kind, parameter or module, reason) over the run: its first step, how many steps it held and
    the last of them (`figures.steps`, `figures.last_step`); a dead-units finding also keeps its largest fraction and
    that step (`figures.worst`), said at the end of its reason where it is not the first step's."""
    if key in found:
        kept = found[key]
        kept["figures"]["steps"] += 1
        kept["figures"]["last_step"] = finding["step"]
        worst = kept["figures"].get("worst")
        if worst is not None and finding["fraction"] > worst["fraction"]:
            kept["figures"]["worst"] = {"step": finding["step"], "fraction": finding["fraction"]}
            kept["reason"] = (f"{kept['reason'].split('; at most ')[0]}; at most {finding['fraction']:.1%} "
                              f"(step {finding['step']})")
    else:
        figures = finding.setdefault("figures", {})
        figures["steps"], figures["last_step"] = 1, finding["step"]
        if finding["kind"] == "dead-units":
            figures["worst"] = {"step": finding["step"], "fraction": finding["fraction"]}
        found[key] = finding


def _layer_findings(rank, steps, found: dict) -> None:
    history = []
    for step in steps:
        total = step.grad_norm
        if not step.skipped and total is not None and math.isfinite(total):
            before = history[-EXPLODING_WINDOW:]
            if len(before) >= EXPLODING_MIN and total > EXPLODING_FACTOR * statistics.median(before):
                median = statistics.median(before)
                _aggregate(found, ("exploding", rank, step.step), {
                    "kind": "exploding", "step": step.step, "rank": rank,
                    "reason": f"the whole gradient's norm {total:.4g} is {total / median:.1f}x the median "
                              f"{median:.4g} of the {len(before)} steps before it (rule: > {EXPLODING_FACTOR:g}x)",
                    "figures": {"grad_norm": total, "median_before": median}})
            history.append(total)
        layers: dict[str, float] = {}
        for name, p in step.parameters.items():
            if p.grad_norm is not None and math.isfinite(p.grad_norm):
                module = name.rpartition(".")[0]
                layers[module] = layers.get(module, 0.0) + p.grad_norm ** 2
        largest = math.sqrt(max(layers.values(), default=0.0))
        for module, squared in layers.items():
            norm = math.sqrt(squared)
            if 0 < norm < VANISHING_RATIO * largest:
                _aggregate(found, ("vanishing", rank, module), {
                    "kind": "vanishing", "step": step.step, "rank": rank, "module": module,
                    "reason": f"its gradient norm {norm:.3g} is {norm / largest:.1e} of the largest module's "
                              f"{largest:.3g} in the same step (rule: < {VANISHING_RATIO:g})",
                    "fraction": norm / largest})


def _step_figures(rank, step, line: dict | None) -> dict:
    dead = {}
    for module, pair in ((line or {}).get("dead_units") or {}).items():
        if isinstance(pair, list) and len(pair) == 2 and pair[1]:
            dead[module] = pair[0] / pair[1]
    return {"step": step.step, "rank": rank,
            "noise_scale": json_number(noise_scale(step.micro_grad_norms, step.grad_norm)),
            "micro_batches": len(step.micro_grad_norms), "dead_units": dead, "update_ratio": update_ratios(step)}


def parameter_layer(name: str) -> str:
    """A parameter's layer: its module's layer in the grouping the FLOPs, memory and compare panels use
    (flop_analysis.layer_of: `transformer.h.3.attn.c_attn.weight` -> `transformer.h.3`); "(model)" for a parameter
    of the root module itself."""
    module = name.rpartition(".")[0]
    return layer_of(module) if module else "(model)"


def no_gradient_layers(recording: Recording, rank: int = 0) -> dict[int, set[str]]:
    """{step: the layers with a trainable parameter that got no gradient that step} from the debug log (the recorder
    writes no figure for such a parameter; empty for a recording made without the per-node figures)."""
    out: dict[int, set[str]] = {}
    for step, line in read_debug(recording, rank).steps.items():
        for entry in line.get("no_gradient") or []:
            if entry.get("parameter"):  # read_debug checked each entry: a dict, its parameter a name or None
                out.setdefault(step, set()).add(parameter_layer(entry["parameter"]))
    return out


def _root_sum_squares(values: list) -> float | None:
    """sqrt of the sum of squares; None if a value is missing; NaN and inf kept (they are findings, not noise)."""
    if not values or any(v is None for v in values):
        return None
    return math.sqrt(sum(v * v for v in values))


def layer_figures(steps: list, figure: str) -> list[tuple[int, str, float | None]]:
    """(step, layer, value) for every layer of every step, layers in the order first seen: "grad_norm" is the L2 norm
    of the layer's whole gradient (of its parameters' gradient norms), "update_ratio" its update's norm over its
    weights' norm; None where a figure is missing (a skipped step's update)."""
    rows = []
    for step in steps:
        groups: dict[str, list] = {}
        for name, p in step.parameters.items():
            groups.setdefault(parameter_layer(name), []).append(p)
        for layer, params in groups.items():
            if figure == "grad_norm":
                value = _root_sum_squares([p.grad_norm for p in params])
            else:
                update = _root_sum_squares([p.update_norm for p in params])
                weight = _root_sum_squares([p.weight_norm for p in params])
                value = None if update is None or not weight or step.skipped else update / weight
            rows.append((step.step, layer, value))
    return rows


def update_ratios(step) -> dict:
    """Per module (the parameters' owner): |update| / |weight| over its parameters together, sqrt(sum of squared
    update norms) / sqrt(sum of squared weight norms); compare with the ~1e-3 rule of thumb of the CS231n notes
    (Karpathy, "Neural Networks Part 3"). Modules with no update (a skipped or hand-closed step) are left out."""
    if step.skipped:  # the GradScaler skipped optimizer.step(): no update (the recorder's update norms read 0)
        return {}
    sums: dict[str, list[float]] = {}
    for name, p in step.parameters.items():
        if p.update_norm is None or p.weight_norm is None or not math.isfinite(p.update_norm):
            continue
        pair = sums.setdefault(name.rpartition(".")[0], [0.0, 0.0])
        pair[0] += p.update_norm ** 2
        pair[1] += p.weight_norm ** 2
    return {module: math.sqrt(u) / math.sqrt(w) for module, (u, w) in sums.items() if w > 0}


def analyse(recording: Recording) -> dict:
    """`{"findings": [...], "steps": [per step: noise_scale, dead_units, update_ratio], "forward_checked": [ranks]}`
    for every rank of the recording (`forward_checked`: the ranks recorded with check_forward, whose nodes carry
    source lines)."""
    findings, figures, once, checked = [], [], {}, []
    for rank in recording.ranks:
        log = read_debug(recording, rank)
        if log.sources:
            checked.append(rank)
        steps = recording.steps(rank)
        last_finite = None  # the last step whose weights were all finite before its forward
        for index, step in enumerate(steps):
            line = log.steps.get(step.step) or {}
            losses = line.get("losses") or []
            loss_bad = any(v is not None for v in losses)
            forward = _forward_findings(rank, step, line, loss_bad)
            findings += forward
            # the loss is read only on steps with per-node figures; the weights' figures are on every step
            weights = _already_bad(step, last_finite) if loss_bad or not step.backward_graphs else ""
            findings += _backward_findings(recording, rank, step, index, log, loss_bad,
                                           any(f["kind"] == "nonfinite-forward" for f in forward), weights)
            if not step.backward_graphs:
                findings += _unplaced_findings(rank, step, weights)
            if not _nonfinite(step, "weight_norm"):
                last_finite = step
            for entry in line.get("no_gradient") or []:
                if isinstance(entry, dict):
                    placed_at = entry.get("cut")  # a detach or no_grad: the node the cut output entered
                    at = {"node": placed_at["op"], "node_id": f"{placed_at['op']}:{placed_at['row']}",
                          "backward": placed_at["backward"]} if placed_at else {}
                    _aggregate(once, ("no-gradient", rank, entry.get("parameter"), entry.get("reason")), {
                        "kind": "no-gradient", "step": step.step, "rank": rank, "parameter": entry.get("parameter"),
                        "module": entry.get("module") or "", "reason": entry.get("reason"), **at})
            step_figures = _step_figures(rank, step, line)
            for module, fraction in step_figures["dead_units"].items():
                if fraction >= DEAD_FRACTION:
                    _aggregate(once, ("dead-units", rank, module), {
                        "kind": "dead-units", "step": step.step, "rank": rank, "module": module,
                        "fraction": fraction, "reason": f"{fraction:.1%} of its units were zero for the whole batch "
                                                        f"(rule: >= {DEAD_FRACTION:.0%})"})
            figures.append(step_figures)
        _layer_findings(rank, steps, once)
    findings += list(once.values())
    order = {kind: i for i, kind in enumerate(KINDS)}
    findings.sort(key=lambda f: (f.get("rank", 0), f.get("step", 0), order[f["kind"]]))
    return {"findings": findings, "steps": figures, "forward_checked": checked}


def analyse_config(config, check_forward: bool = False) -> dict:
    """The findings of one step of `config`'s model: one real forward and backward on its example batch, recorded
    into a temporary folder by the same recorder as a user's loop (no optimizer step), then `analyse`d."""
    return debug_step(config, check_forward)[0]


def debug_step(config, check_forward: bool = False) -> tuple[dict, list[nx.DiGraph]]:
    """`analyse_config`'s result and the recorded graph of each backward of the step, every node with its recorded
    figures (what the explorer's Debug view draws the findings on)."""
    with tempfile.TemporaryDirectory(prefix="graphviz-core-debug-") as folder:
        record_step(config, folder, check_forward=check_forward)
        recording = open_recording(folder)
        steps = recording.steps()
        graphs = [recording.step_graph(steps[0].step, 0, b) for b in range(len(steps[0].backward_graphs))] \
            if steps else []
        result = analyse(recording)
    import torch

    inside = [f for f in result["findings"] if f.get("replay")]
    if inside and hasattr(torch.compiler, "set_stance"):  # a finding inside a region: the step again, eagerly
        with tempfile.TemporaryDirectory(prefix="graphviz-core-debug-") as folder:
            record_step(config, folder, check_forward=check_forward, eager=True)
            _replayed(inside, analyse(open_recording(folder))["findings"])
    return result, graphs


def _replayed(inside: list[dict], eager: list[dict]) -> None:
    """Each compiled-region finding gets `eager_replay`: the same kind of finding in the same backward of the step
    replayed eagerly (its node, module, source line), or None where the eager step found none; `replay` and a clause
    of `reason` say the same in words."""
    for finding in inside:
        match = next((f for f in eager if f["kind"] == finding["kind"] and
                      f.get("backward") == finding.get("backward")), None)
        if match is None:
            finding["eager_replay"] = None
            said = "the same step replayed eagerly found no such node (compiled and eager arithmetic can differ)"
        else:
            finding["eager_replay"] = {k: match.get(k) for k in ("node", "node_id", "module", "source", "reason")}
            said = "".join([f"the same step replayed eagerly starts at {match.get('node')}",
                            f" in {match['module']}" if match.get("module") else "",
                            f" ({match['source']})" if match.get("source") else ""])
        finding["replay"] = said + " (torch.compiler.set_stance(\"force_eager\"), the same weights and batch)"
        finding["reason"] += f"; {said}"


def finding_node(graph: nx.DiGraph, finding: dict) -> str | None:
    """The node of `graph` a finding is placed at: its own node, else the AccumulateGrad node of its parameter (a
    parameter whose gradient was exactly zero is in the graph; one that got none is not)."""
    node = finding.get("node_id")
    if node in graph:
        return node
    name = finding.get("parameter")
    if name:
        for n, data in graph.nodes(data=True):
            if (data.get("param") or {}).get("name") == name:
                return n
    return None


def record_step(config, folder: str, check_forward: bool = False, eager: bool = False) -> None:
    """Record one forward and backward of `config`'s model (weights and batch from its seed, under its autocast, with
    its LoRA or frozen parameters, torch.compile'd with --compile: AOTAutograd's regions, backend `aot_eager`) into
    `folder`; `eager=True` runs the compiled model eagerly (the replay). Refused with a sentence: the meta device (no
    values) and checkpointing (the step runs without it)."""
    import torch

    from graphviz_core.capture.autocast import autocast_device_type
    from graphviz_core.capture.device import resolve_device
    from graphviz_core.capture.recorder import record
    from graphviz_core.models.registry import build_model, compute_loss, make_batch

    if config.device == "meta":
        raise ValueError("debug needs real values; --device meta computes shapes only (use cpu or auto).")
    if config.checkpoint != "none":
        raise ValueError("debug of a preset runs without activation checkpointing: --checkpoint none (the default).")
    device = resolve_device(config.device)
    with torch.device(device):
        model = build_model(config)
    batch = make_batch(config, device)
    model.train()
    autocast = torch.autocast(autocast_device_type(device), dtype=getattr(torch, config.autocast)) \
        if config.autocast != "none" else contextlib.nullcontext()
    from graphviz_core.capture import step_gate

    with contextlib.ExitStack() as compiling:
        if config.compile:  # alone in the process, dynamo's caches empty before and after (no state carried over)
            from graphviz_core.capture.compiled import dynamo_alone

            compiling.enter_context(step_gate.alone())
            compiling.enter_context(dynamo_alone())
            model.compile(backend="aot_eager", dynamic=False)  # in place: no wrapper module for the global hooks
        else:  # never beside a compiled capture: the recorder's module hooks are the process's
            compiling.enter_context(step_gate.shared())
        with record(folder, model=model, check_forward=check_forward, eager=eager) as rec:
            with autocast:
                loss = compute_loss(config, model(batch.inputs), batch.targets)
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                raise ValueError("the preset's loss needs no gradient; nothing to debug.")
            loss.backward()
            rec.step()
