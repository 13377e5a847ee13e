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
        # from gpt2-tiny to each family's toy size: hidden, heads, layers... are the same; these are not
        ("llama", ["Key-value heads", "MLP width", "Model family"]),
        ("bert", ["MLP width", "Context", "Model family"]),
    ],
)
def test_the_stale_form_notice_names_the_fields_by_their_labels(family, labels):
    at = AppTest.from_file(APP, default_timeout=120).run()
    at.selectbox(key="config.model").set_value(family).run()
    stale = [plain(w.value) for w in at.sidebar.warning]
    assert stale == [f"The form differs from the result shown ({', '.join(labels)}); press Run to capture it."]
