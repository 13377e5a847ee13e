"""The compare page's training-step pairs in Chromium, clicked at a laptop's size and photographed at a desktop's too:
each button (fp32 vs bf16 autocast, full fine-tuning vs LoRA, eager vs compiled, AdamW vs SGD) loads B = A with that
one setting changed, both configs are captured and the pair's sentence shows; every label reads whole (page errors
fail the test)."""

import pytest

from tests.conftest import LAPTOP, both_sizes, cut_off, table_rows

pytestmark = pytest.mark.browser

# label -> the start of the sentence it shows for gpt2-tiny (A as the page opens), a figure from it, and the row of
# the "What changed" table (the field's label in graphviz_core.fields, A's value, B's): the 23 casts and 9 frozen
# matmul weights are counted in tests/test_compare_training.py; the rest are the pair's own words
PAIRS = {
    "fp32 vs bf16 autocast": ("autocast none → bfloat16", "cast nodes (ToCopyBackward0, autocast's own) 0 → 23",
                              ["Mixed precision (autocast)", "none", "bfloat16"]),
    "Full fine-tuning vs LoRA": ("finetune 'full' → 'lora'", "the gradient matmuls of the 9 matmul weights",
                                 ["Fine-tuning", "full", "lora"]),
    "Eager vs compiled": ("compile False → True", "1 CompiledFunctionBackward", ["torch.compile", "False", "True"]),
    "AdamW vs SGD": ("optimizer adamw → sgd", "SGD keeps no state", ["Optimizer", "adamw", "sgd"]),
}


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_each_training_pair_button_compares_and_explains(page, streamlit_url, tmp_path):
    page.goto(streamlit_url)
    page.locator('[data-testid="stSidebarNav"]').get_by_text("Compare two configs").click()
    page.locator('[data-testid="stMetric"]').filter(has_text="Nodes per layer").wait_for(timeout=120_000)
    row = page.locator(".st-key-compare-training-pairs")
    for label, (start, figure, changed) in PAIRS.items():
        button = row.get_by_role("button", name=label, exact=True)
        # the label is whole: no ellipsis, the text as wide as its box at most
        assert button.evaluate("b => { const p = b.querySelector('p') || b; return p.scrollWidth <= p.clientWidth + 1 }"), label
        button.click()
        sentence = page.locator('[data-testid="stMarkdownContainer"] li').filter(has_text=start)
        sentence.wait_for(timeout=180_000)
        assert figure in sentence.inner_text(), sentence.inner_text()
        # the table of what changed: the one field, both values read whole
        table = page.locator('[data-testid="stTable"]').filter(has_text="field").first
        assert changed in table_rows(page, table, 1), label
        assert cut_off(table.locator("td, th")) == [], label  # a data grid cut "adamw" to "adam" at 1280 px
        if label == "Eager vs compiled":  # every layer keeps 31 fewer autograd nodes, its ops run in one compiled
            # node: the pair shows whole-graph nodes with that said, not "Nodes per layer -31"
            assert page.locator('[data-testid="stMetric"]').filter(has_text="Nodes per layer").count() == 0
        # config B's header names the change where the description carries it
        header = page.locator('[data-testid="stExpander"] summary').filter(has_text="Config B")
        assert header.count() == 1
        sentence.scroll_into_view_if_needed()
        both_sizes(page, tmp_path / f"compare-{label.split()[0].lower()}", full_page=False)
    assert not page.errors, page.errors
