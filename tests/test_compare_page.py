"""AppTests of the compare page on gpt2-tiny pairs (b=2, s=32, h=64, nh=4, V=512, L=2 layers)."""

import json
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from tests.conftest import captured, cut_off, idle

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "compare.py")
L = 2


def _sentences(at) -> list[str]:
    return [m.value.replace("\\", "") for m in at.markdown if m.value.startswith("- ")]


def _headline(at):
    return next(d.value for d in at.dataframe if "B − A" in d.value.columns and "" in d.value.columns).set_index("")


def test_first_visit_compares_sdpa_with_manual_attention_plus_19_nodes_per_layer():
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception and not at.error
    metrics = {m.label: m.value for m in at.metric}
    # manual attention per layer: +20 spelled-out nodes (transpose, 2 bmm, 4 expand, 4 clone, 5 unsafe view,
    # 1 view, mul, masked_fill, softmax) - the fused kernel's 1 node = +19 (tests/test_compare.py derives it)
    assert metrics["Nodes per layer"] == "+19"
    headline = _headline(at)
    a, b = captured("gpt2-tiny").summary.nodes, captured("gpt2-tiny", attention="manual").summary.nodes
    assert (a, b) == (101, 101 + L * 19)
    assert headline.loc["Nodes", "A"] == "101" and headline.loc["Nodes", "B"] == "139"
    assert headline.loc["Nodes", "B − A"] == "+38"
    assert any("+19 nodes per layer" in s and "keeps the s×s probabilities" in s for s in _sentences(at))
    by_op = next(d.value for d in at.dataframe if "op" in d.value.columns).set_index("op")
    assert by_op.loc["BmmBackward0", "B − A"] == L * 2  # q@kᵀ and p@v per layer
    assert len(at.get("iframe")) == 2  # both graphs drawn, own nodes highlighted


def test_batch_quick_pair_changes_no_node_and_says_why():
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    at.button(key="compare.pair.Batch 1 vs 8").click().run()
    assert not at.exception
    headline = _headline(at)
    assert headline.loc["Nodes", "B − A"] == "same"  # the graph does not depend on the batch ("Why Your Transformer Block Has 50 Backward Nodes")
    assert any("does not depend on batch" in s for s in _sentences(at))


def test_checkpoint_quick_pair_explains_the_recompute():
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    at.button(key="compare.pair.No checkpointing vs full").click().run()
    assert not at.exception
    assert any(s.startswith("- checkpointing none → full") for s in _sentences(at))
    # A is sdpa from the first pair and stays so; both sides now differ only in checkpointing
    assert at.session_state["compare.a.applied"].attention == "sdpa"
    assert at.session_state["compare.b.applied"].checkpoint == "full"


def test_an_invalid_b_is_refused_with_a_sentence_and_the_comparison_stays():
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    at.number_input(key="compare.b.hidden").set_value(70)
    next(b for b in at.button if b.label == "Use as B").click().run()
    assert not at.exception
    assert any("not divisible by 4 heads" in e.value for e in at.error)
    assert {m.label: m.value for m in at.metric}["Nodes per layer"] == "+19"


def test_config_headers_say_which_attention_and_checkpointing_each_side_runs():
    from graphviz_core.export.render import run_description

    at = AppTest.from_file(PAGE, default_timeout=120).run()
    labels = [e.label for e in at.expander if e.label.startswith("Config ")]
    # the first-visit pair is gpt2-tiny with sdpa (A) against manual attention (B): the headers must differ, each the
    # preset's name (where it is one) and the description the explorer's line and the exported pictures use
    a, b = at.session_state["compare.a.applied"], at.session_state["compare.b.applied"]
    assert labels == [f"Config A: gpt2-tiny · {run_description(a)}", f"Config B: {run_description(b)}"]
    assert labels[0].endswith("· sdpa attention (fused) · no checkpointing"), labels
    assert labels[1].endswith("· manual attention (spelled-out) · no checkpointing"), labels
    at.button(key="compare.pair.No checkpointing vs selective").click().run()
    labels = [e.label for e in at.expander if e.label.startswith("Config ")]
    policy = at.session_state["compare.b.applied"].checkpoint  # the family's own selective policy
    assert policy.startswith("selective")
    assert labels[0].endswith("· sdpa attention (fused) · no checkpointing"), labels
    assert labels[1].endswith(f"· sdpa attention (fused) · checkpoint {policy}"), labels


@pytest.mark.browser
@pytest.mark.parametrize("page", [(1280, 800)], indirect=True)
def test_no_quick_pair_button_is_cut_off_at_1280(page, streamlit_url, tmp_path):
    # four a row cut 'Fused vs spelled-out atten…' and 'No checkpointing vs selec…' at 1280x800
    page.goto(f"{streamlit_url}/compare")
    page.locator('[data-testid="stMetricLabel"]', has_text="Nodes per layer").wait_for(timeout=120_000)
    idle(page)
    page.wait_for_timeout(500)
    texts = page.evaluate(
        """() => [...document.querySelectorAll('.st-key-compare-pairs button')].map(b => b.innerText.trim())"""
    )
    assert len(texts) == 7 and "No checkpointing vs selective" in texts, texts  # every quick pair is drawn
    cut = cut_off(page.locator(".st-key-compare-pairs button *"))
    page.screenshot(path=str(tmp_path / "compare-1280.png"))
    assert cut == [], f"quick-pair buttons cut off at 1280x800: {cut}"


def test_a_meta_pair_is_captured_by_two_worker_processes_at_once_and_both_read_measured_now(monkeypatch):
    """Llama-tiny on meta, sdpa vs eager: the page starts B in the meta worker pool before it waits for A, so both
    run at once; each side's line says it was measured for this page, not found in the cache."""
    from graphviz_core.capture import workers as processes
    from graphviz_core.serve.shared_captures import shared_captures

    assert processes.wait_for_pool(120)
    store = shared_captures()
    store.clear()
    spans = {}

    def timed(config, **kwargs):
        started = time.perf_counter()
        capture = processes.capture_anywhere(config, **kwargs)
        spans[config.attention] = (started, time.perf_counter())
        return capture

    monkeypatch.setattr(store, "_capture", timed)
    at = AppTest.from_file(PAGE, default_timeout=120)
    for key, value in {"a.preset": "llama-tiny", "b.preset": "llama-tiny", "a.device": "meta", "b.device": "meta",
                       "b.attention": "eager"}.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    origin = [c.value for c in at.caption if "nodes on meta" in c.value]
    assert len(origin) == 2 and all(line.startswith("Captured ") and "measured now" in line for line in origin), origin
    a = captured("llama-tiny", device="meta")
    b = captured("llama-tiny", device="meta", attention="eager")
    assert _headline(at).loc["Nodes", "A"] == f"{a.summary.nodes:,}" and _headline(at).loc["Nodes", "B"] == f"{b.summary.nodes:,}"
    (a_start, a_end), (b_start, b_end) = spans["sdpa"], spans["eager"]
    assert b_start < a_end and a_start < b_end  # the two waits overlapped: B did not start after A was done


def _layer_rows(at) -> list[list[str]]:
    """The rows (y domain) of each per-layer chart, top to bottom."""
    specs = [json.loads(chart.proto.spec) for chart in at.get("vega_lite_chart")]
    return [s["encoding"]["y"]["scale"]["domain"] for s in specs if s["encoding"]["y"]["field"] == "layer"]


def test_llama_8b_vs_70b_rows_run_in_forward_order_with_a_marked_gap():
    """86 rows (embeddings, 80 layers, final norm, head, the model's and the rotary table's forward-only rows, the
    loss) are too many: the first 20 and the last 20 are drawn, and one row stands for the 86 - 40 = 46 between them,
    model.layers.19 - 64 (the first 20 are the embeddings and layers 0-18; the last 20 are layers 65-79 and the 5 rows
    after them). 13 of them are 8B's (layers 19-31), all 46 are 70B's."""
    at = AppTest.from_file(PAGE, default_timeout=300).run()
    at.button(key="compare.pair.Llama 3.1 8B vs 70B (meta)").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    gap = "… 46 not drawn: model.layers.19 – 64 …"
    expected = [
        "model.embed_tokens",
        *(f"model.layers.{i}" for i in range(19)),
        gap,
        *(f"model.layers.{i}" for i in range(65, 80)),
        "model.norm",
        "lm_head",
        "model",
        "model.rotary_emb",
        "(loss and glue)",
    ]
    assert _layer_rows(at) == [expected, expected]  # saved bytes and FLOPs, the same rows
    captions = [c.value.replace("\\", "") for c in at.caption]
    gap_line = (
        "the row “… 46 not drawn …” stands for the 46 between them (model.layers.19 – model.layers.64): "
        "13 of A's and 46 of B's."
    )
    assert any(
        c.startswith("86 rows (layers, embeddings, head, loss) in forward order") and gap_line in c for c in captions
    ), captions


def test_a_seq_set_on_a_picked_preset_is_the_users_change_not_the_architectures():
    """The tester's path: Config B, preset bert-tiny, sequence length 16, Use as B (A stays gpt2-tiny). bert-tiny's
    seq is 32 like gpt2-tiny's, so only context 0 -> 64 and intermediate 0 -> 256 come with BERT; seq 32 -> 16 is
    the user's and gets seq's own sentence."""
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    at.selectbox(key="compare.b.preset").set_value("bert-tiny").run()
    at.number_input(key="compare.b.seq").set_value(16)
    next(b for b in at.button if b.label == "Use as B").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    model, seq = _sentences(at)
    assert "Also changed: context 0 → 64, intermediate 0 → 256; these come with the other architecture" in model
    assert "seq 32 → 16" not in model.partition("Not from the architecture")[0]
    assert seq.startswith("- seq 32 → 16: no node added or removed — the graph's shape does not depend on seq")


def test_the_changed_fields_are_listed_by_their_declared_labels_and_units():
    """Issue 34 item 4: the compare page names the fields A and B differ in by the labels and units every view reads
    (graphviz_core.fields), above the sentences that explain them. gpt2-tiny against bert-tiny at sequence length 16:
    the family, the sequence length (in tokens), the context (tokens) and the MLP width."""
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    at.selectbox(key="compare.b.preset").set_value("bert-tiny").run()
    at.number_input(key="compare.b.seq").set_value(16)
    next(b for b in at.button if b.label == "Use as B").click().run()
    assert not at.exception
    table = at.table[0].value.map(lambda cell: cell.replace("\\", ""))  # st.table's cells are escaped Markdown
    rows = {r["field"]: (r["A"], r["B"]) for r in table.to_dict("records")}
    assert rows["Model family"] == ("gpt2", "bert")
    assert rows["Sequence length"] == ("32 tokens", "16 tokens")
    assert rows["Context"] == ("0 (the sequence length)", "64 tokens")  # gpt2-tiny's 0 stands for its default
    assert rows["MLP width"] == ("n/a", "256")  # the built-in GPT-2 has no such field
