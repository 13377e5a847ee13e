"""Beyond one GPU with LoRA, clicked in Chromium: choosing LoRA in the sidebar's Fine-tuning box and pressing Use
this model simulates FSDP with the adapters as the only trained parameters, the Plan tab plans the LoRA model,
and tensor parallel, with and without sequence parallel, splits the adapters (page errors fail the test)."""

import pytest
from playwright.sync_api import expect

from graphviz_core.ui.format import format_bytes
from tests.conftest import LAPTOP, both_sizes, choose, open_tab

pytestmark = pytest.mark.browser

LORA = "LoRA (base weights frozen)"


def _metric(page, label: str) -> str:
    metric = page.locator('[data-testid="stMetric"]').filter(has_text=label)
    return metric.locator('[data-testid="stMetricValue"]').inner_text()


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_lora_over_fsdp_from_the_sidebar(page, streamlit_url, tmp_path):
    page.goto(f"{streamlit_url}/parallel?preset=llama-tiny&strategy=fsdp&world_size=4")
    page.get_by_text("Rank 0 next to one device").wait_for(timeout=180_000)
    # Full fine-tuning first: every gradient's quarter, 139,584 scalars x 4 bytes / 4 ranks.
    assert _metric(page, "Gradients per rank") == format_bytes(139_584)
    sidebar = page.locator('[data-testid="stSidebar"]')
    choose(page, sidebar.get_by_role("combobox", name="Fine-tuning", exact=True), LORA)
    sidebar.get_by_role("spinbutton", name="LoRA rank r").wait_for(timeout=30_000)
    sidebar.get_by_role("button", name="Use this model").click()
    note = page.get_by_text("Fine-tuning: LoRA adapters of rank 8 on q_proj, v_proj train")
    note.wait_for(timeout=180_000)
    # LoRA r=8 on q_proj and v_proj: 2 layers x (8*64 + 64*8 + 8*64 + 32*8) = 3,584 scalars, x 4 bytes / 4 ranks.
    assert _metric(page, "Gradients per rank") == format_bytes(3_584)
    # AdamW: 2 x 3,584 bytes of moments + a 4-byte step for each of the 8 adapter tensors.
    assert _metric(page, "Optimizer state per rank") == format_bytes(7_200)
    # Every weight, frozen included, still sharded over 4: (139,584 + 3,584) x 4 / 4 bytes.
    assert _metric(page, "Parameters per rank") == format_bytes(143_168)
    note.scroll_into_view_if_needed()
    both_sizes(page, tmp_path / "parallel-lora", full_page=False)
    page.get_by_role("tab", name="Communication in backward").click()
    both_sizes(page, tmp_path / "parallel-lora-collectives", full_page=True)

    # The Plan tab plans the LoRA model: 2 GPUs in a node of 2, global batch 4 (FSDP 2, TP 2 and PP 2 layouts).
    open_tab(page, "Plan")
    form = page.locator('[data-testid="stForm"]').filter(has_text="GPUs in all")
    form.get_by_role("spinbutton", name="GPUs in all").fill("2")
    form.get_by_role("spinbutton", name="Global batch (sequences per optimizer step)").fill("4")
    form.get_by_role("spinbutton", name="GPUs per node").fill("2")
    form.get_by_role("button", name="Plan the layouts").click()
    table = page.locator('[data-testid="stTable"]').filter(has_text="Tokens/s per GPU (estimate)")
    table.wait_for(timeout=300_000)
    assert "FSDP 2, none, microbatch 1" in table.inner_text() and "TP 2 + SP, none, microbatch 1" in table.inner_text()
    both_sizes(page, tmp_path / "parallel-lora-plan", full_page=True)

    # Tensor parallel 2: the adapters split as peft splits them (B by columns beside q and v, A whole): 2 layers x
    # (512 + 256 + 512 + 128) = 2,816 scalars x 4 bytes of gradients on each rank.
    page.goto(f"{streamlit_url}/parallel?preset=llama-tiny&finetune=lora&strategy=tp&world_size=2&tp=2")
    page.get_by_text("Fine-tuning: LoRA adapters of rank 8 on q_proj, v_proj train").wait_for(timeout=180_000)
    expect(page.get_by_role("spinbutton", name="TP degree")).to_have_value("2", timeout=30_000)  # the form caught up
    assert _metric(page, "Gradients per rank") == format_bytes(11_264)
    both_sizes(page, tmp_path / "parallel-lora-tp-split", full_page=False)
    # With sequence parallel on as well: the same adapter gradients (q and v are column-split), and the page's
    # sequence-parallel tab.
    page.get_by_text("Sequence parallel (with TP)", exact=True).click()
    page.get_by_role("button", name="Simulate ranks").click()
    page.get_by_role("tab", name="Context and sequence parallel").wait_for(timeout=180_000)
    assert _metric(page, "Gradients per rank") == format_bytes(11_264)
    page.mouse.move(page.viewport_size["width"] - 20, 20)  # no button tooltip (hover or focus) in the screenshot
    page.evaluate("document.activeElement && document.activeElement.blur()")
    both_sizes(page, tmp_path / "parallel-lora-sp", full_page=False)
