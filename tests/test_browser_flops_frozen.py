"""The FLOPs tab in Chromium: under LoRA the linear layers' expected backward / forward says what frozen weights do to
the 2× (no weight-gradient matmul), beside the measured ratio; on a model the GPT-2 derivation does not cover, that
section is one line, not a heading over nothing (page errors fail the test)."""

import pytest

from graphviz_core.analysis.flop_analysis import FAMILIES, ratios_by_family
from graphviz_core.units import format_ratio
from tests.conftest import LAPTOP, both_sizes, captured

pytestmark = pytest.mark.browser
TAB = "FLOPs%20and%20time"


def _main(page):
    return page.locator('[data-testid="stMain"]')


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_lora_linear_row_expects_1x_for_frozen_weights(page, streamlit_url, tmp_path):
    capture = captured("gpt2-tiny", finetune="lora")
    (linear,) = [r for r in ratios_by_family(capture) if r.family == FAMILIES["aten.mm"]]
    # every base weight frozen: most linears keep dx only (1x), some none at all: measured under the 2x of training
    assert linear.ratio < 1.5
    page.goto(f"{streamlit_url}/?preset=gpt2-tiny&finetune=lora&tab={TAB}")
    row = _main(page).get_by_role("row").filter(has_text=FAMILIES["aten.mm"])
    row.first.wait_for(timeout=120_000)
    text = row.first.inner_text()
    assert "1.00× frozen, 2.00× trained" in text and format_ratio(linear.ratio) in text, text
    # frozen: every parameter of the full run; trained: the adapters on qkv, 2 layers x r*(in+out) = 2 x 8*(64+192)
    frozen = captured("gpt2-tiny").summary.parameter_count
    assert capture.summary.frozen_parameter_count == frozen
    total = frozen + 2 * 8 * (64 + 192)
    assert f"{capture.summary.frozen_parameter_count:,} of the {total:,} parameters are frozen" in text, text
    assert "gets no dW" in text
    row.first.scroll_into_view_if_needed()
    both_sizes(page, tmp_path / "flops-lora", full_page=False)


def test_the_gpt2_derivation_is_one_line_on_llama(page, streamlit_url, tmp_path):
    page.goto(f"{streamlit_url}/?preset=llama-tiny&tab={TAB}")
    line = _main(page).get_by_text("Backward FLOPs op by op, fused vs spelled-out attention: derived for the built-in")
    line.wait_for(timeout=120_000)
    assert not _main(page).get_by_role("heading", name="Backward FLOPs op by op").count()
    line.scroll_into_view_if_needed()
    both_sizes(page, tmp_path / "flops-llama", full_page=False)
