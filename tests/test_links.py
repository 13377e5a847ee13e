"""Links: the config and the graph view in the URL, read back into the same page; bad values fall back with a notice."""

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from graphviz_core.config import ModelConfig, config_from_preset
from graphviz_core.export.render import render_html
from graphviz_core.ui.links import (
    LINKED_NODE,
    config_params,
    link_url,
    parse_config,
    parse_node,
    parse_view,
    view_params,
)
from tests.conftest import captured
from tests.test_app import plain
from tests.test_render import graph_data

APP = str(Path(__file__).resolve().parent.parent / "app.py")


@pytest.mark.parametrize(
    "config",
    [
        config_from_preset("gpt2-small"),
        # changed from a preset: the form names such a config by its fields, not the preset (config_form._named)
        config_from_preset("gpt2-tiny", layers=3, attention="manual").replace(preset=""),
        config_from_preset("llama-tiny", tied=True, checkpoint="selective", seed=7).replace(preset=""),
        ModelConfig(model="mlp", hidden=32, layers=3, batch=4, seq=8),
        config_from_preset("llama-tiny", autocast="float16", optimizer="adafactor").replace(preset=""),
    ],
)
def test_a_config_survives_the_round_trip_through_the_url(config):
    params = config_params(config)
    assert parse_config(params) == (config, [])
    # prefixed for the compare page's two forms, and unaffected by the other form's parameters
    both = {**config_params(config, "a."), **config_params(ModelConfig(seed=3), "b.")}
    assert parse_config(both, "a.") == (config, [])


def test_a_link_naming_a_presets_former_name_opens_the_preset_it_became():
    # llama-70b-shape was llama-3.1-70b under a second name; links made with it still open that config
    assert parse_config({"preset": "llama-70b-shape"}) == (config_from_preset("llama-3.1-70b"), [])
    assert config_params(parse_config({"preset": "llama-70b-shape"})[0]) == {"preset": "llama-3.1-70b"}
    # seed-block named the textbook block after the source file it came from; it is transformer-block now
    assert parse_config({"preset": "seed-block"}) == (config_from_preset("transformer-block"), [])


def test_autocast_and_the_optimizer_travel_in_a_link_and_the_config_line_names_them():
    from graphviz_core.export.render import run_description

    config = config_from_preset("gpt2-tiny", autocast="bfloat16", optimizer="sgd-momentum")
    assert config_params(config) == {"autocast": "bfloat16", "optimizer": "sgd-momentum"}  # gpt2-tiny: the defaults
    line = run_description(config, "cpu")
    assert line.endswith("· no checkpointing · bfloat16 autocast · SGD with momentum optimizer"), line
    assert "autocast" not in run_description(config_from_preset("gpt2-tiny"), "cpu")  # defaults unnamed
    assert "float16 autocast + GradScaler" in run_description(config.replace(autocast="float16"), "cpu")


def test_an_exact_preset_is_linked_by_its_name_and_other_configs_by_the_fields_that_differ():
    assert config_params(config_from_preset("gpt2-small")) == {"preset": "gpt2-small"}
    # gpt2-tiny is ModelConfig's defaults; 3 layers differ from them in one field
    assert config_params(config_from_preset("gpt2-tiny", layers=3)) == {"layers": "3"}
    assert link_url("http://127.0.0.1:8501/?x=1", {"layers": "3", "search": "a b"}) == (
        "http://127.0.0.1:8501/?layers=3&search=a+b"
    )


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"layers": "two"}, "layers='two' is not a whole number"),
        ({"tied": "maybe"}, "tied='maybe' is not on or off"),
        ({"preset": "gpt5"}, "there is no preset 'gpt5'"),
        ({"hidden": "770", "heads": "12"}, "hidden 770 is not divisible by 12 heads"),
        ({"model": "custom", "preset": "evil.py:f"}, "there is no preset 'evil.py:f'"),
        ({"model": "custom"}, "a link cannot name your own model"),
        ({"device": "/etc/passwd"}, "device"),
        ({"autocast": "int8"}, "autocast"),
        ({"optimizer": "lion"}, "optimizer"),
    ],
)
def test_a_bad_config_in_a_link_is_refused_with_a_sentence(params, problem):
    config, problems = parse_config(params)
    assert config is None and problem in "; ".join(problems)


def test_view_values_are_parsed_into_known_options_only():
    values, problems = parse_view({"collapse": "1", "colour": "flops", "size": "rainbow", "search": "x" * 201})
    assert values == {"view.collapse": True, "view.colour": "flops"}
    assert problems == [  # in the order of the view's controls: search, then size
        "the search text is longer than 200 characters",
        "size='rainbow' is not one of (none), time_s, flops, saved_bytes, grad_norm",
    ]
    assert view_params({"view.collapse": True, "view.colour": "category", "view.search": "Addmm"}) == {
        "collapse": "1",
        "search": "Addmm",
    }


def test_a_link_opens_the_page_with_its_config_and_view():
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"layers": "3", "collapse": "1", "colour": "flops", "focus": "blocks.1", "search": "Addmm"})
    at.run()
    assert not at.exception and not at.warning
    assert at.metric[0].value == f"{captured('gpt2-tiny', layers=3).summary.nodes:,}"  # 3 layers: 144 nodes
    assert at.toggle(key="view.collapse").value is True
    assert at.selectbox(key="view.colour").value == "flops"
    assert at.selectbox(key="view.focus").value == "blocks.1"
    assert at.text_input(key="view.search").value == "Addmm"
    assert at.number_input(key="config.layers").value == 3
    # the URL now says the same (focus written once the capture showed the model has blocks.1)
    linked = {"layers": "3", "collapse": "1", "colour": "flops", "focus": "blocks.1", "search": "Addmm"}
    assert {k: at.query_params[k] for k in at.query_params} == linked


def test_a_stale_or_bad_link_falls_back_to_the_defaults_with_a_notice():
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"hidden": "770", "heads": "12", "colour": "purple", "focus": "transformer.h.9"})
    at.run()
    assert not at.exception
    assert at.metric[0].value == f"{captured('gpt2-tiny').summary.nodes:,}"  # the default preset: 101 nodes
    notices = [plain(w.value) for w in at.warning]
    assert any("config could not be used (hidden 770 is not divisible by 12 heads" in n for n in notices)
    assert any("colour='purple' is not one of" in n for n in notices)
    assert any("focus='transformer.h.9' is not a module of this model" in n for n in notices)
    assert at.selectbox(key="view.focus").value == "(whole model)"
    # Run dismisses the notices
    next(b for b in at.button if b.label == "Run backward pass").click().run()
    assert not at.warning


def test_a_compare_link_opens_its_pair():
    page = str(Path(__file__).resolve().parent.parent / "pages" / "compare.py")
    at = AppTest.from_file(page, default_timeout=120)
    # the pair as the compare page links it: a.* for config A, b.* for config B (3 vs 2 layers of gpt2-tiny)
    at.query_params.update({"a.layers": "3", "b.preset": "gpt2-tiny"})
    at.run()
    assert not at.exception and not at.warning
    headline = next(d.value for d in at.dataframe if "B − A" in d.value.columns and "" in d.value.columns)
    nodes = headline.set_index("").loc["Nodes"]
    a, b = captured("gpt2-tiny", layers=3).summary.nodes, captured("gpt2-tiny").summary.nodes
    assert (a, b) == (144, 101)  # one layer fewer: 43 nodes fewer
    assert (nodes["A"], nodes["B"], nodes["B − A"]) == ("144", "101", "-43")
    assert {k: at.query_params[k] for k in at.query_params} == {"a.layers": "3", "b.preset": "gpt2-tiny"}
    # the forms' titles say the same (they are drawn before the link is read, so the page draws itself again)
    labels = [e.label for e in at.expander if e.label.startswith("Config")]
    assert labels[0].startswith("Config A:") and "· 3 layers ·" in labels[0]
    assert labels[1].startswith("Config B:") and "· 2 layers ·" in labels[1]


@pytest.mark.parametrize(
    ("params", "node", "problem"),
    [
        ({"node": "AddmmBackward0:17"}, "AddmmBackward0:17", None),
        ({"node": "module:blocks.0"}, "module:blocks.0", None),  # a collapsed module's node
        ({}, None, None),
        ({"node": ""}, None, None),
        ({"node": "x" * 301}, None, "node= is not a node id"),  # over NODE_MAX = 300 characters
        ({"node": "Addmm\nBackward0:1"}, None, "node= is not a node id"),  # a control character
    ],
)
def test_a_node_in_a_link_is_parsed_as_an_id_only(params, node, problem):
    got, problems = parse_node(params)
    assert got == node
    assert (problem is None and problems == []) or problem in problems[0]


def test_a_node_link_keeps_its_node_and_a_stale_one_falls_back_with_a_notice():
    capture = captured("gpt2-tiny", layers=3)
    # gpt2-tiny's blocks.0 qkv matmul (3 layers): a node of the graph as drawn
    node = next(
        n for n, d in capture.graph.nodes(data=True) if d["module"] == "blocks.0.attn.qkv" and d["category"] == "matmul"
    )
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"layers": "3", "node": node})
    at.run()
    assert not at.exception and not at.warning
    assert at.session_state[LINKED_NODE] == (config_from_preset("gpt2-tiny", layers=3).replace(preset=""), node)
    assert {k: at.query_params[k] for k in at.query_params} == {"layers": "3", "node": node}
    # the same node with shape ops hidden is still drawn (a matmul); a view node (shape) would not be
    for stale in ("NoSuchBackward0:7", next(n for n, d in capture.graph.nodes(data=True) if d["category"] == "shape")):
        at = AppTest.from_file(APP, default_timeout=120)
        at.query_params.update({"layers": "3", "hide_shape": "1", "node": stale})
        at.run()
        assert not at.exception
        notices = [plain(w.value) for w in at.warning]
        assert any(f"node='{stale}' is not in this graph as drawn" in n for n in notices), notices
        assert "node" not in at.query_params and LINKED_NODE not in at.session_state


def test_the_drawn_page_opens_on_the_linked_node_only_when_the_graph_has_it():
    graph = captured("gpt2-tiny").graph
    node = "AddmmBackward0:17"  # gpt2-tiny's blocks.0 attn.proj matmul (ids are deterministic; checked below)
    assert graph.nodes[node]["module"] == "blocks.0.attn.proj"
    opened = graph_data(render_html(graph, selected=node, node_links=True))
    assert (opened["selected"], opened["node_links"]) == (node, True)
    assert graph_data(render_html(graph, selected="NoSuchBackward0:1"))["selected"] is None
    assert graph_data(render_html(graph))["node_links"] is False  # a downloaded page links to no app page


TOY = str(Path(__file__).resolve().parent.parent / "pages" / "toy_expressions.py")
PARALLEL = str(Path(__file__).resolve().parent.parent / "pages" / "parallel.py")


def test_the_toy_page_links_its_expression_values_and_toggles():
    """Issue 33 item 12: the toy page had no link. Its URL now holds the expression, each value (v.NAME) and the two
    toggles; a link opens the page with them."""
    at = AppTest.from_file(TOY, default_timeout=60).run()
    # the first preset, "Transformer Math"'s worked example, as the address bar writes it
    assert {k: at.query_params[k] for k in at.query_params} == {"expr": "(a*b + c)**2", "v.a": "2", "v.b": "-3",
                                                                 "v.c": "10"}
    at = AppTest.from_file(TOY, default_timeout=60)
    at.query_params.update({"expr": "a*b + a**2", "v.a": "3", "v.b": "-2.5", "detach": "b", "twice": "1"})
    at.run()
    assert not at.exception and not at.warning
    assert at.text_input(key="expr.text").value == "a*b + a**2"
    assert {box.label: box.value for box in at.number_input} == {"a": 3.0, "b": -2.5}
    assert at.multiselect(key="expr.detach").value == ["b"] and at.toggle(key="expr.twice").value is True
    at.number_input(key="expr.var.a").set_value(5.0).run()  # an edit is in the address bar at once
    assert at.query_params["v.a"] == "5" and at.query_params["detach"] == "b" and at.query_params["twice"] == "1"


@pytest.mark.parametrize("params, notice", [
    ({"expr": "a +* b"}, "expr= is not an expression this page takes"),
    ({"expr": "a*2", "v.a": "٢"}, "v.a='٢' is not a finite number written with the digits 0-9"),
    ({"expr": "a*2", "v.z": "1"}, "v.z= names no variable of the expression"),
    ({"expr": ["a*2", "a*3"]}, "expr= is given 2 times"),
])
def test_a_toy_link_that_cannot_be_used_opens_the_first_example_with_a_notice(params, notice):
    at = AppTest.from_file(TOY, default_timeout=60)
    at.query_params.update(params)
    at.run()
    assert not at.exception
    assert any(notice in plain(w.value) for w in at.warning), [w.value for w in at.warning]
    assert at.text_input(key="expr.text").value == "(a*b + c)**2"
    assert at.query_params["expr"] == "(a*b + c)**2"  # the address bar says what is shown


def test_the_parallel_pages_link_keeps_its_open_tab():
    """Issue 33 item 12: the parallel page's link dropped its open tab. The tabs are bound to ?tab=; a tab the page
    does not have is dropped with a notice (no pipeline tab without a pipeline)."""
    at = AppTest.from_file(PARALLEL, default_timeout=120)
    at.query_params["tab"] = "Plan"
    at.run()
    assert not at.exception and not at.warning
    assert at.session_state["tab"] == "Plan" and at.query_params["tab"] == "Plan"
    at = AppTest.from_file(PARALLEL, default_timeout=120)
    at.query_params["tab"] = "Pipeline stages"  # FSDP over 8 (the page's default) has no pipeline
    at.run()
    assert not at.exception and "tab" not in at.query_params
    assert any("tab='Pipeline stages' is not one of Memory per rank, Communication in backward, Plan" in plain(w.value)
               for w in at.warning)
