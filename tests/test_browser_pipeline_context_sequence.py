"""Beyond one GPU with a pipeline and context parallel, then a pipeline and sequence parallel, set in the sidebar's form
and simulated in Chromium: the Pipeline stages tab and the Context and sequence parallel tab (one layer of a stage
per microbatch, measured = counted), clicked at a laptop's size and photographed at a desktop's too (page errors
fail)."""

import pytest

from graphviz_core.ui.format import format_bytes
from tests.conftest import LAPTOP, both_sizes, open_tab, table_rows

pytestmark = pytest.mark.browser


def _pipeline_of_two(page) -> None:
    page.get_by_role("spinbutton", name="Pipeline stages (pp)").fill("2")
    page.get_by_role("spinbutton", name="Microbatches").fill("2")  # llama-tiny's batch of 2: microbatches of 1


def _simulate(page, tmp_path, name: str):
    """Press Simulate ranks; screenshot the Pipeline stages tab, then open the Context and sequence parallel tab."""
    page.get_by_role("button", name="Simulate ranks").click()
    split = page.get_by_role("tab", name="Context and sequence parallel")  # only a result with cp or SP has it
    split.wait_for(timeout=180_000)
    page.get_by_role("tab", name="Pipeline stages").click()
    page.get_by_text("microbatches of 1. Each rank's stages really ran").wait_for(timeout=30_000)
    both_sizes(page, tmp_path / f"{name}-stages", full_page=True)
    split.click()
    panel = page.get_by_role("tabpanel").filter(has_text="Counted by hand")
    panel.get_by_text("With the pipeline: one layer of a stage, per microbatch (1 sequence").wait_for(timeout=30_000)
    return panel


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_pipeline_with_context_then_sequence_parallel_from_the_form(page, streamlit_url, tmp_path):
    page.goto(f"{streamlit_url}/parallel?preset=llama-tiny")  # the page's default layout: FSDP over 8 ranks
    page.get_by_text("Rank 0 next to one device").wait_for(timeout=180_000)
    _pipeline_of_two(page)
    page.get_by_role("spinbutton", name="Context parallel (cp)").fill("2")  # 8 = pp 2 x data 2 x context 2
    panel = _simulate(page, tmp_path, "pp-cp")
    page.get_by_text("each rank holds 16 of the 32 tokens").wait_for(timeout=30_000)
    # One layer at 16 tokens of one sequence: norms 24,704 + attention 12,544 + SwiGLU 32,768 + the ring output's
    # copy 4,096 = 74,112 B (tests/test_pipeline_context_sequence.py derives each term).
    metrics = panel.locator('[data-testid="stMetricValue"]')
    assert metrics.nth(0).inner_text() == metrics.nth(1).inner_text() == format_bytes(74_112)
    ring = panel.locator('[data-testid="stTable"]').filter(has_text="Sent by this rank (recorded)")
    # keys and values of 16 tokens of 1 sequence: 2*1*16*32 float32 = 4 KiB; backward 4 KiB + 2 x 4 KiB of gradients
    cells = [row[-2:] for row in table_rows(page, ring, 2)]
    assert cells == [[format_bytes(4_096), format_bytes(4_096)], [format_bytes(12_288), format_bytes(12_288)]]
    both_sizes(page, tmp_path / "pp-cp", full_page=True)

    # A link to TP 2 inside each of 2 pipeline stages (4 ranks); sequence parallel switched on in the form.
    page.goto(f"{streamlit_url}/parallel?preset=llama-tiny&strategy=tp&world_size=4&tp=2&pp=2&microbatches=2")
    page.get_by_text("Pipeline stages", exact=True).first.wait_for(timeout=180_000)
    page.get_by_text("Sequence parallel (with TP)", exact=True).click()
    panel = _simulate(page, tmp_path, "pp-sp")
    page.get_by_text("the norms run on 1/2 of the tokens").wait_for(timeout=30_000)
    # One layer, TP 2 + SP, microbatch of 1: norms on 16 tokens 16,512 + gathered inputs 16,384 + attention 12,544
    # + SwiGLU 32,768 = 78,208 B; Korthikanti et al. with sequence parallel, 16-bit, s = 32, b = 1:
    # s·b·h/t·(34 + 5·a·s/h) = 1024 x (34 + 10) = 45,056 B.
    metrics = panel.locator('[data-testid="stMetricValue"]')
    assert [metrics.nth(i).inner_text() for i in range(3)] == [
        format_bytes(78_208), format_bytes(78_208), format_bytes(45_056)]
    both_sizes(page, tmp_path / "pp-sp", full_page=True)


def _drop(form, box: str, option: str) -> None:
    """Remove `option` from the multiselect labelled `box` (its chip's remove button)."""
    select = form.locator('[data-testid="stMultiSelect"]').filter(has=form.page.get_by_role("combobox", name=box))
    select.get_by_role("button", name=f"Remove {option}", exact=True).click()


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_the_plan_tab_tries_context_parallel_with_pipeline_stages(page, streamlit_url, tmp_path):
    page.goto(f"{streamlit_url}/parallel?preset=llama-tiny")
    page.get_by_text("Rank 0 next to one device").wait_for(timeout=180_000)
    open_tab(page, "Plan")
    form = page.locator('[data-testid="stForm"]').filter(has_text="GPUs in all")
    # 4 GPUs in a node of 4, global batch 8, full checkpointing, 2 pipeline stages, context parallel 1 or 2 together
    # with the pipeline: FSDP 2 x PP 2, TP 2 + SP x PP 2 and PP 2 x CP 2 (each 4 microbatches of 1 per pipeline step).
    form.get_by_role("spinbutton", name="GPUs in all").fill("4")
    form.get_by_role("spinbutton", name="Global batch (sequences per optimizer step)").fill("8")
    form.get_by_role("spinbutton", name="GPUs per node").fill("4")
    _drop(form, "Checkpointing to try", "none")
    _drop(form, "Pipeline stages to try", "1")
    form.get_by_role("combobox", name="Context-parallel ranks to try").click()
    page.get_by_role("option", name="2", exact=True).click()
    page.keyboard.press("Escape")  # the list stays open after a choice
    form.get_by_text("Context parallel with pipeline stages too").click()
    form.get_by_role("button", name="Plan the layouts").click()
    table = page.locator('[data-testid="stTable"]').filter(has_text="Tokens/s per GPU (estimate)")
    table.wait_for(timeout=300_000)
    rows = table_rows(page, table, 3)
    assert sorted(row[1] for row in rows) == ["FSDP 2 x PP 2, full, microbatch 1", "PP 2 x CP 2, full, microbatch 1",
                                              "TP 2 + SP x PP 2, full, microbatch 1"], rows
    both_sizes(page, tmp_path / "plan-pp-cp", full_page=True)
