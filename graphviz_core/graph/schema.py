"""The node and edge records of a captured graph: every key, what it means, its unit, and which instrument fills it.

A capture (graphviz_core.capture.engine) returns a `networkx.DiGraph` whose node ids are `"{op}:{pre-order index}"`
and whose every node carries the keys of `NodeRecord`; an edge runs from a node to one of its `next_functions`, the
direction the gradient flows (from the loss towards the parameters) and carries no attributes (`EdgeRecord`). The
explorer, the analyses, the exports and the recordings (graphviz_core.graph.recording) all read these keys; the JSON
export (`graph --format json`) writes the graph in networkx's node-link form under `graph`, and its `schema` key is
`SCHEMA_VERSION`. docs/schema.md is the published description, docs/schema.json the JSON Schema generated from here
(`python -m graphviz_core.graph.schema > docs/schema.json`; tests/test_schema.py checks both against a real export).

The classes document and validate; the engine still builds plain dicts (records are read by key across graph/,
analysis/, export/ and ui/). `NodeRecord.from_dict` checks one record's keys and types and says in one sentence what
is wrong, which is what a reader of a file from someone else needs.

SCHEMA_VERSION changes when a key is renamed or removed or its meaning or unit changes; a key added is additive and
leaves it as it is (a reader ignores keys it does not know).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from graphviz_core.units import some_of

SCHEMA_VERSION = 1

# The key names, for code that prefers a constant to a string literal.
OP, CATEGORY, MODULE = "op", "category", "module"
SAVED_BYTES, SAVED, FLOPS, RECOMPUTE_FLOPS = "saved_bytes", "saved", "flops", "recompute_flops"
GRAD_IO_BYTES, GRADIENT_SUM_FLOPS = "grad_io_bytes", "gradient_sum_flops"
TIME_S, GRAD_NORM, PARAM = "time_s", "grad_norm", "param"
BACKWARD_INDEX, RECOMPUTED, COMPILED = "backward_index", "recomputed", "compiled"

# JSON has no NaN or infinity: export.formats writes a non-finite float as its Python name.
NON_FINITE_NAMES = ("nan", "inf", "-inf")


def _key(default: Any, *, json_type: Any, unit: str, by: str, meaning: str) -> Any:
    """A record field: its neutral value (what a capture that did not run the instrument leaves), its JSON Schema
    type, its unit ("" for none), the instrument or step that fills it, and what it means."""
    factory = {"default_factory": (lambda: list(default))} if isinstance(default, list) else {"default": default}
    return field(**factory, metadata={"json": json_type, "unit": unit, "by": by, "meaning": meaning})


_NUMBER_OR_NAME = [{"type": "number"}, {"type": "string", "enum": list(NON_FINITE_NAMES)}]


@dataclass(frozen=True)
class SavedTensor:
    """One tensor saved for a node's backward (an item of `NodeRecord.saved`)."""

    shape: list = _key([], json_type={"type": "array", "items": {"type": "integer", "minimum": 0}}, unit="elements",
                       by="saved", meaning="the saved tensor's shape")
    dtype: str = _key("", json_type={"type": "string"}, unit="", by="saved",
                      meaning="its dtype without the `torch.` prefix (float32, bfloat16, int64...)")
    bytes: int = _key(0, json_type={"type": "integer", "minimum": 0}, unit="bytes", by="saved",
                      meaning="the size of the storage it views (a view of a larger tensor keeps all of it alive)")
    counted: bool = _key(False, json_type={"type": "boolean"}, unit="", by="saved",
                         meaning="whether this node's `saved_bytes` counts it: true for the first save of a storage "
                                 "that is not a parameter's, false for later saves of it and for parameters")
    parameter: bool = _key(False, json_type={"type": "boolean"}, unit="", by="saved",
                           meaning="whether the storage is a parameter's (held anyway, so never counted)")


@dataclass(frozen=True)
class ParamRef:
    """The parameter an AccumulateGrad node writes `.grad` into (`NodeRecord.param`)."""

    name: str = _key("", json_type={"type": "string"}, unit="", by="engine (model.named_parameters)",
                     meaning="the parameter's fully qualified name (`blocks.0.attn.qkv.weight`)")
    shape: list = _key([], json_type={"type": "array", "items": {"type": "integer", "minimum": 0}}, unit="elements",
                       by="engine", meaning="the parameter's shape")


@dataclass(frozen=True)
class NodeRecord:
    """One autograd node of the captured backward: the attributes every node of a capture's graph carries.

    The defaults are the neutral values a capture writes for what it did not measure (`instruments=`): 0 bytes and
    FLOPs, no time, no norm. `compiled` is present only on the CompiledFunctionBackward nodes of a `--compile`
    capture; a collapsed module of a view (graph.views.collapse_modules) carries `ModuleNode`'s keys besides.
    """

    op: str = _key("", json_type={"type": "string", "minLength": 1}, unit="", by="engine (graph walk)",
                   meaning="the autograd node's name, normalised (`AddmmBackward0`, `AccumulateGrad`)")
    category: str = _key("other", json_type={"type": "string"}, unit="",
                         by="engine (graph.categories.category_in_module); casts sets `cast`",
                         meaning="one of graph.categories.CATEGORIES (`module` for a collapsed module of a view)")
    module: str = _key("", json_type={"type": "string"}, unit="", by="modules (module forward hooks)",
                       meaning="the innermost module whose forward created the node, as a dotted path; "
                               "\"\" outside every module (the loss); a parameter's owner for AccumulateGrad")
    saved_bytes: int = _key(0, json_type={"type": "integer", "minimum": 0}, unit="bytes", by="saved",
                            meaning="bytes of the tensors saved for this node's backward that are charged to it: "
                                    "each storage once, at its first save, parameters excluded")
    flops: int = _key(0, json_type={"type": "integer", "minimum": 0}, unit="FLOPs", by="flops",
                      meaning="floating-point operations of every aten op that ran inside this node's backward "
                              "(docs/flop-conventions.md), checkpoint recompute included")
    recompute_flops: int = _key(0, json_type={"type": "integer", "minimum": 0}, unit="FLOPs", by="flops",
                                meaning="of `flops`, those of forward ops re-run by checkpointing inside this node")
    grad_io_bytes: int = _key(0, json_type={"type": "integer", "minimum": 0}, unit="bytes", by="flops",
                              meaning="bytes of the gradients this node's backward read and wrote (roofline traffic)")
    time_s: float | None = _key(None, json_type={"anyOf": [{"type": "number", "minimum": 0}, {"type": "null"}]},
                                unit="seconds", by="timing (perf counter on CPU, CUDA events on a GPU)",
                                meaning="wall time of this node's backward; null on meta or when not measured")
    grad_norm: float | None = _key(None, json_type={"anyOf": [*_NUMBER_OR_NAME, {"type": "null"}]},
                                   unit="gradient units (the loss's unit per the input's unit)", by="norms",
                                   meaning="L2 norm of the gradient leaving the node (what it sends down its edges; "
                                           "for AccumulateGrad what it accumulates), unscaled under a GradScaler; "
                                           "null on meta or when not measured; `nan`/`inf` when not finite")
    param: dict | None = _key(None, json_type={"anyOf": [{"$ref": "#/$defs/ParamRef"}, {"type": "null"}]}, unit="",
                              by="engine", meaning="the parameter an AccumulateGrad node accumulates into "
                                                   "(`ParamRef`); null on every other node")
    saved: list = _key([], json_type={"type": "array", "items": {"$ref": "#/$defs/SavedTensor"}}, unit="", by="saved",
                       meaning="every tensor saved for this node's backward (`SavedTensor`), in save order")
    backward_index: int | None = _key(None, json_type={"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
                                      unit="position", by="order",
                                      meaning="the position at which the autograd engine ran this node (0 first); "
                                              "null when not measured")
    recomputed: bool = _key(False, json_type={"type": "boolean"}, unit="", by="modules",
                            meaning="whether checkpointing made the node while re-running a forward inside backward")
    gradient_sum_flops: int = _key(0, json_type={"type": "integer", "minimum": 0}, unit="FLOPs", by="flops",
                                   meaning="FLOPs of the sums the engine ran to add a second gradient into this "
                                           "node's input (where paths meet), run between nodes")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Any, node_id: str = "a node") -> NodeRecord:
        """The record of one node's attributes, checked: a ValueError with one sentence when a key is missing or of
        the wrong type. Keys it does not know (`compiled`, a view's, a newer version's) are ignored."""
        if not isinstance(data, dict):
            raise ValueError(f"{node_id}'s attributes are a {type(data).__name__}, not an object.")
        missing = [k for k in cls.keys() if k not in data]
        if missing:
            raise ValueError(f"{node_id} lacks the key(s) {some_of(missing, 3)} that every node carries.")
        for f in dataclasses.fields(cls):
            problem = _type_problem(data[f.name], f.metadata["json"])
            if problem:
                raise ValueError(f"{node_id}'s {f.name} {problem}.")
        if data[PARAM] is not None:
            _check_object(ParamRef, data[PARAM], f"{node_id}'s param")
        for item in data[SAVED]:
            _check_object(SavedTensor, item, f"a tensor saved for {node_id}")
        return cls(**{k: data[k] for k in cls.keys()})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ModuleNode:
    """The keys a collapsed module of a view adds (graph.views.collapse_modules; `category` is `module`, the additive
    keys are the members' sums and `time_s` the sum of their measured times)."""

    members: int = _key(0, json_type={"type": "integer", "minimum": 1}, unit="nodes", by="graph.views",
                        meaning="how many nodes were merged into this one")
    by_category: dict = _key(None, json_type={"type": "object", "additionalProperties": {"type": "integer"}},
                             unit="nodes", by="graph.views", meaning="the members' count per category")
    parameters: int = _key(0, json_type={"type": "integer", "minimum": 0}, unit="nodes", by="graph.views",
                           meaning="how many members are AccumulateGrad nodes")


# The NodeRecord keys a collapsed module keeps (summed or set to null); the others it lacks.
MODULE_NODE_KEYS = (OP, CATEGORY, MODULE, SAVED_BYTES, FLOPS, RECOMPUTE_FLOPS, TIME_S, GRAD_NORM, PARAM, SAVED)


@dataclass(frozen=True)
class EdgeRecord:
    """One edge: `source` is a node, `target` one of its `next_functions`; the gradient flows source -> target.
    Captured edges carry no attributes (the toy expressions' graphs add a `label`: the gradient on the edge)."""

    source: str = _key("", json_type={"type": "string"}, unit="", by="engine (graph walk)",
                       meaning="the node nearer the loss, which sends the gradient")
    target: str = _key("", json_type={"type": "string"}, unit="", by="engine (graph walk)",
                       meaning="the node that receives it (one of the source's next_functions)")


def _type_problem(value: Any, schema: dict) -> str:
    """'' when `value` fits the JSON Schema fragment (the few forms this module uses), else what is wrong."""
    if "anyOf" in schema:
        return "" if any(not _type_problem(value, s) for s in schema["anyOf"]) else f"is {_shown(value)}, not allowed"
    if "$ref" in schema:
        return "" if isinstance(value, dict) else f"is {_shown(value)}, not an object"
    kind = schema["type"]
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }
    if not checks[kind](value):
        return f"is {_shown(value)}, not {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
    if "enum" in schema and value not in schema["enum"]:
        return f"is {_shown(value)}, not one of {', '.join(map(str, schema['enum']))}"
    if "minimum" in schema and isinstance(value, (int, float)) and not value >= schema["minimum"]:
        return f"is {value}, below {schema['minimum']}"
    if kind == "string" and len(value) < schema.get("minLength", 0):
        return "is empty"
    if kind == "array" and "items" in schema and "type" in schema["items"]:
        bad = next((v for v in value if _type_problem(v, schema["items"])), None)
        if bad is not None:
            return f"holds {_shown(bad)}, not {schema['items']['type']}s only"
    return ""


def _shown(value: Any) -> str:
    text = json.dumps(value) if not (isinstance(value, float) and not math.isfinite(value)) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_object(cls: type, data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{where} is {_shown(data)}, not an object.")
    for f in dataclasses.fields(cls):
        if f.name not in data:
            raise ValueError(f"{where} lacks its {f.name}.")
        problem = _type_problem(data[f.name], f.metadata["json"])
        if problem:
            raise ValueError(f"{where}'s {f.name} {problem}.")


def _object_schema(cls: type, description: str, required: bool = True) -> dict:
    properties = {f.name: {**f.metadata["json"], "description": _described(f)} for f in dataclasses.fields(cls)}
    out = {"type": "object", "description": description, "properties": properties}
    if required:
        out["required"] = list(properties)
    return out


def _described(f: dataclasses.Field) -> str:
    unit = f" [{f.metadata['unit']}]" if f.metadata["unit"] else ""
    return f"{f.metadata['meaning']}{unit} (filled by: {f.metadata['by']})"


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of `graph --format json`'s `schema` and `graph` keys: the node-link graph
    whose every node is a `NodeRecord` plus its `id`. docs/schema.json is this, written out."""
    node = _object_schema(NodeRecord, " ".join(NodeRecord.__doc__.split()))
    node["properties"]["id"] = {"type": "string", "description": "the node's id: `{op}:{pre-order index}`"}
    # A collapsed module of a view carries ModuleNode's keys and the additive ones; every other node all of them.
    every_key = node.pop("required")
    node["required"] = ["id", OP, CATEGORY, MODULE]
    node["if"] = {"properties": {CATEGORY: {"const": "module"}}}
    node["then"] = {"required": [*MODULE_NODE_KEYS, *(f.name for f in dataclasses.fields(ModuleNode))]}
    node["else"] = {"required": every_key}
    for key, cls in (("members", ModuleNode), ("by_category", ModuleNode), ("parameters", ModuleNode)):
        node["properties"][key] = {**cls.__dataclass_fields__[key].metadata["json"],
                                   "description": "a collapsed module of a view: " + _described(
                                       cls.__dataclass_fields__[key])}
    node["properties"][COMPILED] = {"type": "object", "description": "a CompiledFunctionBackward node of a --compile "
                                    "capture: its region, backward FX graph and saved tensors (capture.compiled)"}
    edge = _object_schema(EdgeRecord, " ".join(EdgeRecord.__doc__.split()))
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"graphviz-core/schema/{SCHEMA_VERSION}",
        "title": "graphviz-core captured graph (graph --format json)",
        "type": "object",
        "required": ["schema", "graph"],
        "properties": {
            "schema": {"const": SCHEMA_VERSION, "description": "graphviz_core.graph.schema.SCHEMA_VERSION"},
            "graph": {
                "type": "object",
                "description": "networkx node-link data (edges under `links`)",
                "required": ["directed", "nodes", "links"],
                "properties": {
                    "directed": {"const": True},
                    "nodes": {"type": "array", "items": {"$ref": "#/$defs/NodeRecord"}},
                    "links": {"type": "array", "items": {"$ref": "#/$defs/EdgeRecord"}},
                },
            },
        },
        "$defs": {
            "NodeRecord": node,
            "EdgeRecord": edge,
            "ParamRef": _object_schema(ParamRef, ParamRef.__doc__),
            "SavedTensor": _object_schema(SavedTensor, SavedTensor.__doc__),
        },
    }


_JSON_NAMES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
               "dict": "object", "None": "null"}


def markdown_table(cls: type = NodeRecord) -> str:
    """The keys of `cls` as a Markdown table (docs/schema.md's tables are these)."""
    rows = ["| key | type | unit | filled by | meaning |", "| --- | --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        kind = " or ".join(_JSON_NAMES.get(part.strip(), part.strip()) for part in str(f.type).split("|"))
        rows.append(f"| `{f.name}` | {kind} | {f.metadata['unit'] or '–'} | {f.metadata['by']} | {f.metadata['meaning']} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m graphviz_core.graph.schema > docs/schema.json
    print(json.dumps(json_schema(), indent=1))  # noqa: T201
