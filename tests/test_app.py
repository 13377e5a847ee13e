"""AppTests: each page runs with no exception and shows real values from a real capture."""

import re
from pathlib import Path

from streamlit.testing.v1 import AppTest

from tests.conftest import captured, tables

APP = str(Path(__file__).resolve().parent.parent / "app.py")


def plain(markdown: str) -> str:
    """What the reader sees of escaped Markdown (user text is backslash-escaped before it is shown)."""
    return re.sub(r"\\(.)", r"\1", markdown)


def test_graph_explorer_runs_the_default_config_and_shows_the_real_node_count():
    at = AppTest.from_file(APP, default_timeout=120).run()
    assert not at.exception
    expected = captured("gpt2-tiny").summary.nodes
    assert at.metric[0].label == "Nodes" and at.metric[0].value == f"{expected:,}"


def test_the_category_table_lists_every_category_most_nodes_first():
    from graphviz_core.ui.format import format_bytes
    from graphviz_core.ui.summary import BAR_MAX_PCT, category_rows

    at = AppTest.from_file(APP, default_timeout=120).run()
    assert not at.exception
    capture = captured("gpt2-tiny")
    rows = category_rows(capture)
    # gpt2-tiny: 101 nodes, 46 of them shape ops (the most: its bar is the full 70%): per block 21 (qkv's Split, 4
    # weight transposes T, 4 head Transposes, 12 Views: 2 around each of 4 Linears and 4 head splits/merges) x 2
    # blocks, lm_head's T, View and UnsafeView, the loss's View: 42 + 3 + 1 = 46. 28 parameters (AccumulateGrad):
    # 12 per block (4 Linears and 2 LayerNorms, weight and bias each) x 2, ln_f's 2, wte, wpe = 28. 70 * 28 / 46 = 42.6%
    assert (rows[0]["category"], rows[0]["nodes"], rows[0]["bar_pct"]) == ("shape", 46, BAR_MAX_PCT)
    assert (rows[1]["category"], rows[1]["nodes"], round(rows[1]["bar_pct"], 1)) == ("accumulate_grad", 28, 42.6)
    assert sum(r["nodes"] for r in rows) == capture.summary.nodes
    table = at.get("html")[0].proto.body
    shown = re.findall(r"<tr><td>([a-z_]+)</td><td><span [^>]+></span>([\d,]+)</td>", table)
    assert shown == [(r["category"], f"{r['nodes']:,}") for r in rows]
    matmul = format_bytes(capture.memory.saved_bytes_by_category["matmul"])
    assert "<td>matmul</td>" in table and f'<td style="text-align:right">{matmul}</td>' in table


def test_an_invalid_config_is_shown_as_an_error_and_the_page_keeps_serving():
    at = AppTest.from_file(APP, default_timeout=120).run()
    at.number_input(key="config.hidden").set_value(770)
    at.number_input(key="config.heads").set_value(12)
    next(b for b in at.button if b.label == "Run backward pass").click().run()
    assert not at.exception
    assert any("not divisible by 12 heads" in e.value for e in at.error)
    assert at.metric[0].label == "Nodes"  # the last good capture is still shown


def test_graph_view_hands_the_iframe_every_node():
    import json
    import re

    at = AppTest.from_file(APP, default_timeout=120).run()
    assert not at.exception
    html = at.get("iframe")[0].proto.srcdoc
    data = json.loads(re.search(r'id="graph-data" type="application/json">(.*?)</script>', html, re.S).group(1))
    assert len(data["nodes"]) == captured("gpt2-tiny").summary.nodes


EXPRESSIONS = str(Path(__file__).resolve().parent.parent / "pages" / "toy_expressions.py")


def test_toy_expressions_steps_to_the_end_and_shows_the_final_gradients():
    at = AppTest.from_file(EXPRESSIONS, default_timeout=60).run()
    assert not at.exception
    assert at.text_input(key="expr.text").value == "(a*b + c)**2"
    assert not at.subheader  # final gradients appear only at the end
    # "Transformer Math"'s backward has 6 steps: L, e, c.grad, d, a.grad, b.grad
    for _ in range(6):
        at = next(b for b in at.button if b.label == "Next ›").click().run()
    assert at.slider(key="expr.step").value == 6
    assert [h.value for h in at.subheader] == ["Final gradients"]
    final = at.dataframe[-1].value
    assert list(final["backprop (autograd)"]) == ["-24", "16", "8"]


def test_toy_expressions_shows_a_bad_expression_as_an_error():
    at = AppTest.from_file(EXPRESSIONS, default_timeout=60).run()
    at.text_input(key="expr.text").set_value("__import__('os')").run()
    assert not at.exception
    assert any("Unknown function '__import__'" in plain(e.value) for e in at.error)  # a sentence: capital first


def test_graph_explorer_shows_the_textbook_comparison_with_real_numbers():
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["tab"] = "Measured vs textbook"  # only the open tab is drawn
    at.run()
    assert [h.value for h in at.subheader] == ["Measured vs textbook"]
    flops = tables(at)[1]
    # gpt2-tiny: lm_head backward 4*b*s*h*V = 4*2*32*64*512 = 8_388_608 -> "8.4 MFLOP", measured = textbook
    assert flops.loc["lm_head (4bshV)", "measured"] == "8.4 MFLOP"
    assert flops.loc["lm_head (4bshV)", "measured / textbook"] == "1.000"


def test_a_config_too_big_for_this_machine_is_refused_with_a_sentence(monkeypatch):
    monkeypatch.setenv("GRAPHVIZ_CORE_CPU_BUDGET_BYTES", str(2**30))  # a 1 GiB budget
    at = AppTest.from_file(APP, default_timeout=120).run()
    at.selectbox(key="config.preset").set_value("gpt2-small").run()
    at.selectbox(key="config.device").set_value("cpu")
    at.number_input(key="config.batch").set_value(16)
    next(b for b in at.button if b.label == "Run backward pass").click().run()
    assert not at.exception
    # gpt2-small at b=16, s=1024 needs far more than 1 GiB (logits alone: 3 x 16*1024*50257 x 4 B ≈ 9.2 GiB)
    assert any("budget there is 1.0 GiB" in plain(e.value) and "'meta'" in e.value for e in at.error)


def test_the_llama_70b_preset_runs_on_meta_from_the_form():
    at = AppTest.from_file(APP, default_timeout=180).run()
    at.selectbox(key="config.preset").set_value("llama-3.1-70b").run()
    at.number_input(key="config.layers").set_value(4)  # same per-layer graph as 80 layers, faster to render
    next(b for b in at.button if b.label == "Run backward pass").click().run()
    assert not at.exception
    assert at.metric[0].value == f"{captured('llama-3.1-70b', layers=4).summary.nodes:,}"
    assert any("shapes only" in c.value for c in at.caption)


def test_a_dry_run_at_bf16_names_where_it_differs_from_a_cpu_run():
    # Issue 12 item 15: the meta kernel keeps LayerNorm's mean and 1/std in float32, CPU in bf16; gpt2-tiny
    # has 5 LayerNorms over 2·32 = 64 rows: 5 × 2 × 64 × 2 B = 1,280 B = 1.2 KiB (format_bytes, one decimal).
    at = AppTest.from_file(APP, default_timeout=120)
    for name, value in {"preset": "gpt2-tiny", "dtype": "bfloat16", "device": "meta"}.items():
        at.query_params[name] = value
    at.run()
    assert not at.exception
    notes = [c.value for c in at.caption if "dry run and a CPU run differ" in c.value]
    assert len(notes) == 1 and "saves 1.2 KiB less (5 LayerNorms)" in notes[0], notes


def test_only_the_open_tab_is_drawn_and_panel_choices_survive_switching_tabs():
    # The explorer draws the open tab only (a first page is the graph, sooner); a choice made in a panel is
    # still there after visiting another tab (Streamlit forgets undrawn widgets unless the page keeps them).
    at = AppTest.from_file(APP, default_timeout=120).run()
    assert not at.exception
    assert len(at.get("iframe")) == 1 and not at.subheader  # the graph; no textbook panel
    assert "Peak memory" not in [m.label for m in at.metric]  # no memory panel
    at.selectbox(key="view.colour").set_value("flops").run()
    at.session_state["tab"] = "Memory"  # what a click on the tab does
    at.run()
    assert "Peak memory" in [m.label for m in at.metric] and not at.get("iframe")
    at.selectbox(key="memory.budget_choice").set_value("40 GB (A100 40GB)").run()
    at.session_state["tab"] = "Graph"
    at.run()
    assert at.selectbox(key="view.colour").value == "flops"
    at.session_state["tab"] = "Memory"  # what a click on the tab does
    at.run()
    assert at.selectbox(key="memory.budget_choice").value == "40 GB (A100 40GB)"
    assert "Step peak (AdamW)" in [m.label for m in at.metric]  # the config's optimizer (the form's Optimizer)
    assert not at.exception and not at.warning


def test_the_memory_tab_follows_the_configs_optimizer_and_autocast():
    from tests.conftest import explorer_tab

    at = explorer_tab("Memory", preset="llama-tiny", optimizer="sgd-momentum", autocast="bfloat16")
    assert not at.exception
    assert "Step peak (SGD with momentum)" in [m.label for m in at.metric]
    assert at.selectbox(key="config.optimizer").value == "sgd-momentum"  # the form shows the link's choices
    assert at.selectbox(key="config.autocast").value == "bfloat16"
    assert any(m.value == "##### One training step (SGD with momentum, bfloat16 autocast)" for m in at.markdown)
    table = next(t for t in tables(at) if "part" in t.columns)
    # llama-tiny: 139,584 fp32 parameters; SGD's momentum is one fp32 buffer each: 4 x 139,584 B = 545.2 KiB
    assert list(table["part"]) == ["weights", "gradients", "optimizer state", "activations at their peak",
                                   "bfloat16 weight copies", "sum of the parts", "step peak"]
    assert table.set_index("part").loc["optimizer state", "bytes"] == "545.2 KiB"
    assert any("torch.autocast('cpu', bfloat16)" in c.value.replace("\\", "") for c in at.caption)


def test_the_line_under_the_figures_names_the_checkpointing_that_produced_them():
    from tests.conftest import explorer_tab

    # qwen2-tiny selective vs full: the headline figures read the same (Saved for backward 177.3 KiB) while the Memory
    # tab's Saved + held differs, so the line under the figures is what tells the two results apart
    lines = {}
    for policy in ("selective", "full"):
        at = explorer_tab("Graph", preset="qwen2-tiny", checkpoint=policy)
        assert not at.exception
        lines[policy] = plain(next(c.value for c in at.caption if c.value.startswith("Loss ")))
        applied = at.session_state["config.applied"].checkpoint  # the policy's own name (the family's selective)
        assert applied.startswith(policy)
        assert lines[policy].endswith(f"· float32 · cpu · sdpa attention (fused) · checkpoint {applied}"), lines[policy]
        assert "qwen2 · 2 layers · h=64 · 4 heads / 2 kv · b=2 · s=32" in lines[policy]
    at = explorer_tab("Graph", preset="qwen2-tiny")
    line = plain(next(c.value for c in at.caption if c.value.startswith("Loss ")))
    assert "config: preset qwen2-tiny · qwen2 · " in line and line.endswith("· no checkpointing"), line
