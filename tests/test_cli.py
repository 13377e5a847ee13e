"""The `graphviz-core` CLI: the JSON contract, the other formats, and one-line errors with exit 2."""

import json
import subprocess
import xml.etree.ElementTree as ET

import pytest

from graphviz_core.cli import main
from tests import docs_zygote


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return docs_zygote.run_cli(args, timeout=300, env={"GRAPHVIZ_CORE_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})


def test_bad_config_exits_2_with_one_line_and_no_traceback():
    done = run_cli("graph", "--hidden", "770", "--heads", "12")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "graphviz-core: hidden 770 is not divisible by 12 heads; pick a hidden size that is a multiple of 12 (e.g. 768)."]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args",
    [["graph", "--batch", "zero"], ["graph", "--model", "resnet9"], ["graph", "--bogus"], ["nope"], [],
     ["graph", "--preset", "gpt2-small", "--batch", "4096", "--device", "cpu"],
     # issue 7's bad inputs: unknown family or size, a field the family lacks, heads vs hidden, kv vs heads
     ["graph", "--preset", "llama-3.1-9b"], ["graph", "--model", "gpt2", "--kv-heads", "2"],
     ["graph", "--model", "llama", "--hidden", "66"], ["graph", "--model", "llama", "--kv-heads", "3"],
     ["graph", "--model", "vit", "--seq", "64"], ["graph", "--model", "resnet", "--layers", "20"],
     # issue 12 item 19: the seed is bounded (2**64 - 1 used to overflow inside torch)
     ["graph", "--seed", "-1"], ["graph", "--seed", "18446744073709551615"]],
)
def test_bad_input_is_always_one_line_exit_2(args, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_json_has_the_contract_keys_and_the_real_graph(tmp_path):
    out = tmp_path / "g.json"
    assert main(["graph", "--preset", "gpt2-tiny", "--format", "json", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"schema", "config", "device", "summary", "memory", "flops", "time", "graph"} <= set(data)
    assert data["schema"] == 1 and data["device"] == "cpu"
    assert set(data["config"]) >= {"model", "hidden", "heads", "layers", "vocab", "batch", "seq", "attention",
                                   "checkpoint", "device", "dtype", "seed"}
    assert {"nodes", "edges", "by_category", "by_op", "parameters", "parameter_count"} <= set(data["summary"])
    assert {"saved_bytes", "parameter_bytes", "peak_bytes"} <= set(data["memory"])
    assert {"forward", "backward", "backward_by_category"} <= set(data["flops"])
    assert {"forward_s", "backward_s"} <= set(data["time"])
    assert len(data["graph"]["nodes"]) == data["summary"]["nodes"]
    assert len(data["graph"]["links"]) == data["summary"]["edges"]
    # gpt2-tiny has 2 blocks x 12 parameter tensors + wte (tied with lm_head) + wpe + ln_f weight and bias = 28
    assert data["summary"]["parameters"] == 28


def test_flags_override_the_preset():
    done = run_cli("graph", "--preset", "gpt2-tiny", "--layers", "1", "--device", "meta")
    data = json.loads(done.stdout)
    assert data["config"]["layers"] == 1 and data["device"] == "meta"
    # meta measures no time: wall and thread-CPU times all null
    assert data["time"] == {"forward_s": None, "backward_s": None, "forward_cpu_s": None, "backward_cpu_s": None}


def test_a_presets_former_name_still_works_and_is_not_offered(tmp_path, capsys):
    out = tmp_path / "g.json"
    # llama-70b-shape was llama-3.1-70b under a second name (one layer on meta: the 70B's width, quickly)
    assert main(["graph", "--preset", "llama-70b-shape", "--layers", "1", "-o", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert (config["preset"], config["hidden"], config["kv_heads"], config["device"]) == ("llama-3.1-70b", 8192, 8, "meta")
    with pytest.raises(SystemExit):
        main(["graph", "--help"])
    assert "llama-70b-shape" not in capsys.readouterr().out


def test_graphml_and_dot_describe_the_same_graph(tmp_path):
    graphml, dot = tmp_path / "g.graphml", tmp_path / "g.dot"
    assert main(["graph", "--preset", "mlp", "--layers", "1", "--format", "graphml", "-o", str(graphml)]) == 0
    assert main(["graph", "--preset", "mlp", "--layers", "1", "--format", "dot", "-o", str(dot)]) == 0
    ns = {"g": "http://graphml.graphdrawing.org/xmlns"}
    root = ET.parse(graphml).getroot()
    nodes = root.findall(".//g:node", ns)
    text = dot.read_text()
    # mlp with one layer: MSE, view, addmm, view, view, GELU, view, addmm, view, 4 AccumulateGrad, 2 t = 13
    assert len(nodes) == text.count("[label=") == 13
    assert text.startswith("digraph autograd {")


def test_unwritable_output_is_exit_2(capsys):
    assert main(["graph", "--preset", "mlp", "--format", "dot", "-o", "/nonexistent-dir/x.dot"]) == 2
    assert "cannot write /nonexistent-dir/x.dot" in capsys.readouterr().err


def test_html_is_a_standalone_page_with_every_node(tmp_path):
    out = tmp_path / "g.html"
    assert main(["graph", "--preset", "gpt2-tiny", "--format", "html", "-o", str(out)]) == 0
    html = out.read_text()
    assert html.startswith("<!DOCTYPE html>") and "vis.Network" in html
    # gpt2-tiny: 101 nodes (see test_capture / test_browser); each appears once in the node list
    assert html.count('"shape":"box"') + html.count('"shape":"ellipse"') == 101


def test_svg_uses_graphviz_dot_or_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    import shutil

    out = tmp_path / "g.svg"
    if shutil.which("dot"):
        assert main(["graph", "--preset", "mlp", "--layers", "1", "--format", "svg", "-o", str(out)]) == 0
        svg = out.read_text()
        assert "<svg" in svg and svg.count('class="node"') == 13  # the 13 nodes counted in the graphml test
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["graph", "--preset", "mlp", "--format", "svg"]) == 2
    assert "apt-get install graphviz" in capsys.readouterr().err


def test_expr_prints_the_trace_json():
    done = run_cli("expr", "(a*b + c)**2", "a=2", "b=-3", "c=10", "--format", "json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert {"expression", "value", "grads", "numerical_grads", "steps"} <= set(data)
    assert data["value"] == 16.0 and data["grads"] == {"a": -24.0, "b": 16.0, "c": 8.0}  # "Transformer Math"
    assert len(data["steps"]) == 6


@pytest.mark.parametrize("args", [["expr", "a+", "a=1"], ["expr", "a*b", "a=1"], ["expr", "a", "a=x"],
                                  ["expr", "__import__('os')"],
                                  ["expr", "L*2 + d", "L=3", "d=1"]])  # issue 12 item 5: L names the result
def test_expr_bad_input_is_one_line_exit_2(args, capsys):
    assert main(args) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_png_is_the_html_page_photographed_at_the_requested_size(tmp_path):
    import numpy as np
    from PIL import Image

    out = tmp_path / "mlp.png"
    assert main(["graph", "--preset", "mlp", "--format", "png", "--png-size", "800x600", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(out)
    image.verify()  # a complete, valid PNG (checksums included)
    image = Image.open(out)
    assert image.size == (1600, 1200)  # 800x600 CSS pixels at the default --png-scale 2
    rgb = np.asarray(image.convert("RGB")).astype(int)
    assert rgb.std() > 20  # not blank: white page, dark text, coloured nodes
    # the mlp's Addmm nodes are filled with the matmul colour #1f77b4 = (31, 119, 180): the graph was drawn
    blue = (np.abs(rgb - [31, 119, 180]).sum(axis=2) < 12).sum()
    assert blue > 500, blue


def test_png_lays_the_layers_out_top_to_bottom_as_the_apps_download(tmp_path):
    import re
    import struct

    import networkx as nx

    from graphviz_core.export.render import standalone_png_page
    from tests.conftest import captured

    out = tmp_path / "block.png"
    assert main(["graph", "--preset", "transformer-block", "--batch", "1", "--seq", "16", "--format", "png", "-o", str(out)]) == 0
    capture = captured("transformer-block", batch=1, seq=16)
    layers = nx.dag_longest_path_length(capture.graph) + 1  # the longest chain of nodes from the loss
    assert layers == 32
    # one column of 32 layers, as tall as it must be to read at scale 0.5: (31 x 80 + 60) px x 1.12 (the fit's margin)
    # x 0.5 = 1,422.4, rounded up to 1,423; 1600 wide; at the default --png-scale 2. It was the folded 1600x1000 page
    # (3200x2000 pixels) before
    assert struct.unpack(">II", out.read_bytes()[16:24]) == (3200, 2 * 1423)
    # the page photographed: each layer a row of its own, none beside another
    page, height = standalone_png_page(capture)
    data = json.loads(re.search(r'id="graph-data" type="application/json">(.*?)</script>', page, re.S).group(1))
    assert height == 1423 and len({node["y"] for node in data["nodes"]}) == layers


def test_png_without_chromium_is_one_line_exit_2(monkeypatch, capsys, tmp_path):
    from graphviz_core.export import formats as export

    monkeypatch.setattr(export, "CHROMIUM", str(tmp_path / "no-chromium"))
    assert main(["graph", "--preset", "mlp", "--format", "png", "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PNG needs Chromium" in err and "apt-get install chromium" in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("size", ["big", "10x10", "1600x99999", "0x0"])
def test_png_size_out_of_range_is_one_line_exit_2(size, capsys):
    assert main(["graph", "--preset", "mlp", "--format", "png", "--png-size", size]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_dot_of_a_view_carries_the_screens_fills_highlight_and_an_escaped_legend():
    import shutil

    from graphviz_core.export.formats import to_dot, to_svg
    from tests.conftest import captured

    graph = captured("mlp").graph
    first = next(iter(graph))
    options = dict(fills={first: "#a50026"}, highlight={first}, title='<script>&"x"', legend=[("most FLOPs", "#a50026")])
    dot = to_dot(graph, **options)
    assert "&lt;script&gt;&amp;&quot;x&quot;" in dot and "<script>" not in dot
    line = next(x for x in dot.splitlines() if x.startswith(f'  "{first}" ['))
    # #a50026 = (165, 0, 38): WCAG luminance 0.2126*0.42 + 0.7152*0 + 0.0722*0.019 = 0.09 < 0.179, so white ink
    assert 'fillcolor="#a50026"' in line and 'fontcolor="#ffffff"' in line and "penwidth=4" in line
    if shutil.which("dot"):
        svg = to_svg(graph, **options)
        assert "&lt;script&gt;" in svg and "<script" not in svg and "most FLOPs" in svg


def test_png_size_that_is_not_a_size_states_the_range(capsys):
    # issue 25 item 7: "--png-size takes WIDTHxHEIGHT in pixels, e.g. 1600x1000, not 'big'." said no range
    from graphviz_core.export.formats import png_problem

    for size in ("big", "123456789012x100"):
        assert main(["graph", "--preset", "mlp", "--format", "png", "--png-size", size]) == 2
        assert "each side 100..8000" in capsys.readouterr().err
    # the stated range is the one png_problem applies: 100 and 8000 pass, 99 and 8001 do not
    assert all("out of range" not in (png_problem(w, h, 1) or "") for w, h in ((100, 100), (8000, 8000)))
    assert all("100..8000 pixels a side" in png_problem(w, h, 1) for w, h in ((99, 100), (100, 8001)))
    assert main(["graph", "--preset", "mlp", "--format", "png", "--png-size", "123456x100"]) == 2
    assert "100..8000 pixels a side" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "sentence"), [
    # issue 25 item 7: both were accepted silently (c ignored; the last a won)
    (["a*b", "a=1", "b=2", "c=3"],
     "graphviz-core: c=3 is not a variable of the expression (its variables are a, b); drop it."),
    (["a*b", "a=1", "b=2", "c=3", "d=-4.5"],
     "graphviz-core: c=3 and d=-4.5 are not variables of the expression (its variables are a, b); drop them."),
    (["2*3", "x=1"], "graphviz-core: x=1 is not a variable of the expression (it has no variables); drop it."),
    (["a*b", "a=1", "a=2", "b=2"], "graphviz-core: a is given twice (a=1, then a=2); give each variable one value."),
])
def test_expr_refuses_unused_and_duplicate_values(args, sentence, capsys):
    assert main(["expr", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == sentence and captured.out == ""


@pytest.mark.parametrize(("digits", "where"), [(5000, "argument --seed: takes a whole number of at most 4,000"),
                                               (1000, "seed must be between 0 and 2,147,483,647")])
def test_a_huge_seed_is_not_echoed_whole(digits, where, capsys):
    # issue 25 item 7: the 5,000 digits came back in the error line
    assert main(["graph", "--seed", "9" * digits]) == 2
    err = capsys.readouterr().err
    assert where in err and f"99999999999999999999… ({digits:,} digits)" in err and len(err) < 200, err


@pytest.mark.parametrize(("args", "has", "lacks"), [
    # issue 27 item 6: a ResNet's echo showed heads 4 and seq 32; it has neither, nor attention
    (["--preset", "resnet-tiny"], {"hidden", "layers", "vocab", "batch", "image_size", "seed"},
     {"heads", "seq", "attention", "kv_heads", "context", "experts", "intermediate", "tied"}),
    (["--preset", "gpt2-tiny"], {"heads", "seq", "attention", "context"},
     {"kv_heads", "experts", "experts_per_token", "image_size", "intermediate", "tied"}),
    (["--preset", "llama-tiny"], {"heads", "seq", "kv_heads", "intermediate", "tied"}, {"context", "image_size"}),
])
def test_the_config_echo_shows_the_familys_own_fields(args, has, lacks, capsys):
    from graphviz_core.config import resolve_config

    config = resolve_config(args[1])
    for command in (["graph", *args, "--device", "meta"], ["memory", *args, "--device", "meta"]):
        assert main(command) == 0  # in this process: the echo is the same as a fresh process's, without its start-up
        echoed = json.loads(capsys.readouterr().out)["config"]
        assert has <= set(echoed) and not lacks & set(echoed), (command, echoed)
        assert all(config.family.takes(name) for name in echoed)  # the family's answer, field by field
        assert echoed["hidden"] == config.hidden and echoed["preset"] == args[1]


def test_compare_echoes_each_sides_fields(capsys):
    assert main(["compare", "--preset", "resnet-tiny", "--device", "meta", "--vs", "--preset", "gpt2-tiny",
                 "--device", "meta"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "heads" not in data["a"]["config"] and data["b"]["config"]["heads"] == 4  # gpt2-tiny: 4 heads


def test_each_fields_help_is_said_once_and_names_the_families_that_take_it():
    """The CLI's --help and the form's tooltips read one declaration (models.family.FIELD_HELP); an optional field's
    families come from what each family's config accepts, so --kv-heads names Gemma 3 (a hand-kept list once left
    it out) and every family that takes the field, and no other."""
    from graphviz_core.config import FAMILIES, MODELS, ModelConfig, field_help
    from graphviz_core.models.family import FIELD_HELP, OPTIONAL_FIELDS
    from graphviz_core.ui.config_form import _zero_help

    assert "gemma3" in field_help("kv_heads")
    for name in OPTIONAL_FIELDS:
        if name not in FIELD_HELP:
            continue
        listed = field_help(name).rpartition("(")[2].rstrip(")").split(", ")
        assert listed == [m for m in MODELS if FAMILIES[m].takes(name) and FAMILIES[m].offered], name
    applied = ModelConfig()  # the form: the same meaning, capitalised, then what 0 stands for
    assert _zero_help("kv_heads", applied).startswith("Key-value heads for grouped-query attention. 0 means")
    assert _zero_help("hidden", applied) == "Hidden size; for resnet the stem width (64 in ResNet-50)."
