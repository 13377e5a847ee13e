"""Issue 34 item 4: one declaration per config field (graphviz_core.fields), read by every view: the CLI's flags (kind,
choices, help), the form's labels and size inputs, the sentences' words and the limits."""

import argparse
import dataclasses

from graphviz_core.cli import build_parser
from graphviz_core.config import LIMITS, ModelConfig, choices_of
from graphviz_core.fields import CHOICE, FIELDS, NAMES, SIZE, SIZES, SWITCH, in_form
from graphviz_core.models.family import FIELD_HELP, FIELD_LABELS, FIELD_WORDS, FIELD_ZERO


def test_the_declarations_and_the_config_list_the_same_fields():
    config_fields = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "preset"]
    assert sorted(FIELDS) == sorted(config_fields)
    for name, field in FIELDS.items():  # a size holds a whole number, a switch a bool, the rest text
        default = getattr(ModelConfig, name)
        expected = {SIZE: int, SWITCH: bool, CHOICE: str, NAMES: str}[field.kind]
        assert type(default) is expected, (name, default)
        if field.kind == CHOICE:
            assert default in choices_of(name), name


def _graph_flags() -> dict[str, argparse.Action]:
    graph = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["graph"]
    return {a.dest: a for a in graph._actions}


def test_every_flag_is_made_from_its_declaration():
    flags = _graph_flags()
    for name, field in FIELDS.items():
        action = flags[name]
        assert field.flag in action.option_strings, name
        if field.kind == CHOICE:
            assert tuple(action.choices) == tuple(choices_of(name)), name
        if field.kind == SWITCH:
            assert isinstance(action, argparse.BooleanOptionalAction), name
        if field.kind == SIZE:
            assert action.type is not None and action.type("12") == 12, name
        if field.help:
            assert action.help.startswith(field.help), name


def test_a_changed_declaration_changes_the_flag_the_form_label_and_the_help(monkeypatch):
    """The effect, not the presence: a new label and help in the declaration reach --help and the form's label."""
    from graphviz_core.config import FAMILIES, field_help

    changed = dataclasses.replace(FIELDS["kv_heads"], label="KV heads (test)", help="grouped keys (test)")
    monkeypatch.setitem(FIELDS, "kv_heads", changed)
    # the CLI refuses a typed 0 here (it would read as not set), so its help says no 0; the families from Family.takes
    assert _graph_flags()["kv_heads"].help == "grouped keys (test) (llama, mistral, qwen2, mixtral, gemma3)"
    assert field_help("kv_heads").startswith("grouped keys (test); 0: one per attention head")  # the form's tooltip
    assert FAMILIES["llama"].label("kv_heads") == "KV heads (test)"
    assert FAMILIES["resnet"].label("layers") == "Depth (18, 34, 50, 101, 152)"  # a family's own name for a field stays its own


def test_the_derived_tables_are_the_declarations():
    assert FIELD_LABELS == {n: f.label for n, f in FIELDS.items()}
    assert FIELD_HELP["kv_heads"] == "key-value heads for grouped-query attention"
    assert FIELD_ZERO == {"context": "the sequence length", "kv_heads": "one per attention head, no grouped-query "
                          "attention", "intermediate": "4 × hidden size"}
    assert FIELD_WORDS["heads"] == "attention heads"
    assert LIMITS["hidden"] == 65_536 and "seed" not in LIMITS  # the seed has its own bound (SEED_MAX)
    # the form's size inputs, two to a row, in the declared order
    assert in_form(SIZES) == ("hidden", "heads", "layers", "vocab", "batch", "seq", "kv_heads", "intermediate",
                              "experts", "experts_per_token", "image_size", "context")
