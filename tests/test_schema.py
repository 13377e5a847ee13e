"""graph/schema.py: the node and edge records every capture carries, the published JSON Schema (docs/schema.json)
and tables (docs/schema.md) generated from it, and a real export validated against it."""

import copy
import json
import math
from pathlib import Path

import jsonschema
import pytest

from graphviz_core.capture.engine import capture_backward
from graphviz_core.config import config_from_preset
from graphviz_core.export.formats import capture_to_dict
from graphviz_core.graph import schema
from graphviz_core.graph.schema import SCHEMA_VERSION, EdgeRecord, ModuleNode, NodeRecord, ParamRef, SavedTensor
from graphviz_core.graph.views import collapse_modules

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture(scope="module")
def exported():
    capture = capture_backward(config_from_preset("gpt2-tiny"))
    return capture, json.loads(json.dumps(capture_to_dict(capture)))


def test_a_real_export_validates_against_the_published_json_schema(exported):
    capture, data = exported
    published = json.loads((DOCS / "schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(published)
    jsonschema.validate(data, published)
    assert data["schema"] == SCHEMA_VERSION
    # A collapsed view's module nodes carry ModuleNode's keys and still validate.
    view = json.loads(json.dumps(capture_to_dict(capture, collapse_modules(capture.graph, 2), {"collapse": 2})))
    assert any(n["category"] == "module" for n in view["graph"]["nodes"])
    jsonschema.validate(view, published)


def test_the_schema_fails_an_export_that_breaks_it(exported):
    """The published schema is not vacuous: a missing key, a wrong type, a negative byte count each fail it."""
    _, data = exported
    published = json.loads((DOCS / "schema.json").read_text())
    for breaking in (lambda n: n.pop("saved_bytes"), lambda n: n.update(flops="12"),
                     lambda n: n.update(saved_bytes=-1), lambda n: n.update(grad_norm="big")):
        broken = copy.deepcopy(data)
        breaking(broken["graph"]["nodes"][3])
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, published)


def test_every_captured_node_has_exactly_the_schema_keys(exported):
    """A key the engine or an instrument adds without documenting it here fails this test (and so does one removed)."""
    capture, _ = exported
    for node_id, data in capture.graph.nodes(data=True):
        assert set(data) == set(NodeRecord.keys()), node_id
        record = NodeRecord.from_dict(data, node_id)
        assert record.op == data["op"] and record.saved_bytes == data["saved_bytes"]
    for _, view_node in collapse_modules(capture.graph, 2).nodes(data=True):
        if view_node["category"] == "module":
            assert set(view_node) == {*schema.MODULE_NODE_KEYS, *ModuleNode.__dataclass_fields__}


def test_the_published_files_are_generated_from_the_classes():
    """docs/schema.json and the tables of docs/schema.md are what graph/schema.py generates (regenerate with
    `python -m graphviz_core.graph.schema > docs/schema.json`; the tables with schema.markdown_table)."""
    assert json.loads((DOCS / "schema.json").read_text()) == schema.json_schema()
    doc = (DOCS / "schema.md").read_text()
    for cls in (NodeRecord, ParamRef, SavedTensor, ModuleNode, EdgeRecord):
        assert schema.markdown_table(cls) in doc, cls.__name__
    assert f"now **{SCHEMA_VERSION}**" in doc


def test_a_record_from_someone_else_gets_one_sentence(exported):
    capture, _ = exported
    node_id, good = next((n, d) for n, d in capture.graph.nodes(data=True) if d["op"] == "AccumulateGrad")
    cases = {
        "a list": ([], "attributes are a list, not an object"),
        "no flops": ({k: v for k, v in good.items() if k != "flops"}, "lacks the key(s) flops"),
        "a string count": ({**good, "saved_bytes": "9" * 80}, "saved_bytes is"),
        "a bool count": ({**good, "flops": True}, "flops is true, not an integer"),
        "a bad param": ({**good, "param": {"name": 3, "shape": []}}, "param's name is 3, not a string"),
        "a bad save": ({**good, "saved": [{"shape": [1]}]}, "lacks its dtype"),
    }
    for label, (data, said) in cases.items():
        with pytest.raises(ValueError) as raised:
            NodeRecord.from_dict(data, node_id)
        message = str(raised.value)
        assert said in message, label
        assert "\n" not in message and len(message) < 200, label
    # A non-finite norm in memory is a float (the JSON writes its name): both are accepted.
    assert math.isnan(NodeRecord.from_dict({**good, "grad_norm": float("nan")}).grad_norm)
    assert NodeRecord.from_dict({**good, "grad_norm": "inf"}).grad_norm == "inf"
