"""What a page says when it cannot do what was asked, and how it counts: in words a user reads on the page (AppTest)."""

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from tests.test_app import plain

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")


@pytest.mark.parametrize(
    ("search", "said"),
    [
        # gpt2-tiny: 2 layers x 4 Linear with bias (attn.qkv, attn.proj, mlp.fc, mlp.proj) = 8 AddmmBackward0
        ("Addmm", "8 matches “Addmm”"),
        ("NllLoss", "1 match “NllLoss”"),  # the one loss node
        ("zzz", "no node matches “zzz”"),
    ],
)
def test_the_search_caption_counts_in_words(search, said):
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["search"] = search
    at.run()
    assert not at.exception
    assert any(said in plain(c.value) for c in at.caption), [c.value for c in at.caption]


def test_a_link_notice_reads_one_stop_per_sentence():
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["layers"] = "-5"
    at.run()
    notices = [plain(w.value) for w in at.warning]
    # config.py's sentence ends "got -5." and the notice puts it in brackets: "got -5)", never "got -5.)"
    assert any("(layers must be positive, got -5): the default is shown instead" in n for n in notices), notices
    assert not any(".)" in n for n in notices)


@pytest.mark.parametrize(
    ("family", "labels"),
    [
        # from gpt2-tiny to each family's toy size: hidden, heads, layers... are the same; these are not, named in the
        # order the fields are declared (graphviz_core.fields) and shown: the family first, then its sizes
        ("llama", ["Model family", "Key-value heads", "MLP width"]),
        ("bert", ["Model family", "MLP width", "Context"]),
    ],
)
def test_the_stale_form_notice_names_the_fields_by_their_labels(family, labels):
    at = AppTest.from_file(APP, default_timeout=120).run()
    at.selectbox(key="config.model").set_value(family).run()
    stale = [plain(w.value) for w in at.sidebar.warning]
    assert stale == [f"The form differs from the result shown ({', '.join(labels)}); press “Run backward pass” to "
                     "apply it."]


def test_a_bad_compare_link_is_said_at_the_top_of_the_page():
    at = AppTest.from_file(str(ROOT / "pages" / "compare.py"), default_timeout=120)
    at.query_params.update({"a.preset": "nope", "b.layers": "-5"})
    at.run()
    assert not at.exception
    inside = {w.value for e in at.expander for w in e.warning}  # the forms' own copies, in collapsed expanders
    top = [plain(w.value) for w in at.main.warning if w.value not in inside]
    assert top == [
        "Config A: This link's config could not be used (there is no preset 'nope'): the default is shown instead.",
        "Config B: This link's config could not be used (layers must be positive, got -5): the default is shown "
        "instead.",
    ]


def test_an_unknown_tab_in_a_link_falls_back_to_the_graph_with_a_notice():
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["tab"] = "Bogus"
    at.run()
    assert not at.exception
    notices = [plain(w.value) for w in at.main.warning]
    assert any("tab='Bogus' is not one of Graph, Measured vs textbook, Memory" in n for n in notices), notices
    assert "tab" not in at.query_params  # the address bar no longer names it
    assert at.tabs[0].label == "Graph"


def test_a_parallel_link_sets_the_layout_and_a_bad_one_falls_back_with_a_notice():
    page = str(ROOT / "pages" / "parallel.py")
    at = AppTest.from_file(page, default_timeout=120)
    at.query_params.update({"world_size": "-3", "strategy": "zzz"})
    at.run()
    assert not at.exception
    notices = [plain(w.value) for w in at.main.warning]
    assert any("layout could not be used (unknown strategy 'zzz'" in n for n in notices), notices
    assert at.metric[0].value == "65.9 KiB"  # the default, FSDP over 8 (test_parallel_page: 539648 / 8 bytes)
    assert not {"world_size", "strategy"} & set(at.query_params)
    at = AppTest.from_file(page, default_timeout=120)
    at.query_params.update({"strategy": "tp", "world_size": "2", "tp": "2"})
    at.run()
    assert not at.exception and not at.warning
    assert at.selectbox(key="parallel.strategy").value == "tp"
    assert any(c.value.startswith("tensor parallel over 2 ranks") for c in at.main.caption)


def test_a_refused_layout_is_said_at_the_top_of_the_main_area():
    at = AppTest.from_file(str(ROOT / "pages" / "parallel.py"), default_timeout=120).run()
    at.selectbox(key="parallel.strategy").set_value("fsdp+tp")
    at.number_input(key="parallel.tp").set_value(3)  # world size stays 8: 8 % 3 = 2
    next(b for b in at.button if b.label == "Simulate ranks").click().run()
    assert not at.exception
    assert [plain(e.value) for e in at.main.error] == [
        "Not run: world size 8 is not divisible by TP degree 3; the 2-D mesh is (world / TP) x TP. The result shown "
        "is still that of the last layout run (gpt2, FSDP over 8 ranks)."
    ]
    assert at.metric[0].value == "65.9 KiB"  # still FSDP over 8's figure
