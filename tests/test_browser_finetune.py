"""The form's "Fine-tuning" box and LoRA fields in Chromium: choosing LoRA shows rank, alpha and targets, a run with
r=4 and '*embed*' frozen draws that graph (fewer AccumulateGrad nodes), the config line and the address bar name
it, and the Memory and FLOPs tabs put it beside full fine-tuning (page errors fail the test)."""

from urllib.parse import parse_qs, urlparse

import pytest

from graphviz_core.ui.browser_harness import graph_frame
from tests.conftest import LAPTOP, both_sizes, captured, choose

pytestmark = pytest.mark.browser

LORA = "LoRA (base weights frozen)"


def _sidebar(page):
    return page.locator('[data-testid="stSidebar"]')


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_lora_controls_run_that_step_and_compare_with_full(page, streamlit_url, tmp_path):
    full = captured("llama-tiny")
    lora = captured("llama-tiny", finetune="lora", lora_rank=4, freeze="*embed*")
    page.goto(f"{streamlit_url}/?preset=llama-tiny")
    graph_frame(page, full.summary.nodes, timeout_s=120)
    assert not _sidebar(page).get_by_role("spinbutton", name="LoRA rank r").count()  # full fine-tuning: no LoRA fields
    choose(page, _sidebar(page).get_by_role("combobox", name="Fine-tuning", exact=True), LORA)
    rank = _sidebar(page).get_by_role("spinbutton", name="LoRA rank r")
    rank.wait_for(timeout=30_000)
    _sidebar(page).get_by_role("textbox", name="LoRA targets").wait_for(timeout=10_000)
    assert rank.input_value() == "8"  # peft's usual r=8 until changed
    _sidebar(page).get_by_text("Fine-tuning", exact=True).scroll_into_view_if_needed()
    both_sizes(page, tmp_path / "lora-form", full_page=False)
    rank.fill("4")
    _sidebar(page).get_by_role("textbox", name="Freeze parameters (glob)").fill("*embed*")
    _sidebar(page).get_by_role("button", name="Run backward pass").click()
    # 8 AccumulateGrad nodes for 21: the base weights get none (tests/test_finetune.py counts them with its own walk)
    assert lora.summary.parameters == 8 and full.summary.parameters == 21
    graph_frame(page, lora.summary.nodes, timeout_s=120)
    line = page.locator('[data-testid="stCaptionContainer"]').filter(has_text="LoRA r=4, alpha 16 on q_proj, v_proj")
    line.first.wait_for(timeout=30_000)
    assert "frozen: *embed*" in line.first.inner_text()
    page.get_by_text("Trainable parameters").first.wait_for(timeout=10_000)
    query = parse_qs(urlparse(page.url).query)
    assert query.get("finetune") == ["lora"] and query.get("lora_rank") == ["4"], page.url
    assert query.get("freeze") == ["*embed*"], page.url
    both_sizes(page, tmp_path / "lora-graph", full_page=False)

    for tab, row in (("Memory", "optimizer state (bytes)"), ("FLOPs and time", "backward matmul FLOPs")):
        page.get_by_role("tab", name=tab).click()
        button = page.get_by_role("button", name="Compare full fine-tuning with LoRA r=4")
        button.wait_for(timeout=60_000)
        button.click()
        cell = page.get_by_role("cell", name=row, exact=True)
        cell.wait_for(timeout=120_000)
        page.get_by_text("Full fine-tuning vs LoRA").scroll_into_view_if_needed()
        both_sizes(page, tmp_path / f"lora-{tab.split()[0].lower()}", full_page=False)
