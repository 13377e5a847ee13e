"""Beyond one GPU's Plan tab in Chromium: the form, its progress while the layouts are simulated, the ranked table and
the chart of peak per layout against the GPU's memory, clicked at a laptop's size and photographed at a desktop's too
(page errors fail)."""

import os
import re

import pytest

from tests.conftest import LAPTOP, both_sizes, open_tab, submit

pytestmark = pytest.mark.browser

# The progress bar's text, sampled every frame from the moment the button is pressed (it is gone once the plan ends).
SAMPLE = """() => { window.__progress = [];
  const look = () => { const bar = document.querySelector('[data-testid="stProgress"]');
    if (bar) window.__progress.push(bar.innerText); if (!window.__stop) requestAnimationFrame(look); };
  window.__stop = false; look(); }"""


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_the_plan_tab_ranks_the_layouts_with_progress_and_a_chart(page, streamlit_url, tmp_path):
    page.goto(f"{streamlit_url}/parallel?preset=llama-tiny")
    page.get_by_text("Rank 0 next to one device").wait_for(timeout=180_000)
    open_tab(page, "Plan")
    form = page.locator('[data-testid="stForm"]').filter(has_text="GPUs in all")
    form.get_by_role("textbox", name="Memory per GPU").fill("lots")  # bad input: a sentence, no plan
    submit(page, form.get_by_role("button", name="Plan the layouts"),
           page.locator('[data-testid="stAlert"]').filter(has_text="a memory size is a positive number and a unit"))
    # 2 GPUs, nodes of 2, global batch 4, none and full checkpointing, 1 or 2 pipeline stages: FSDP 2, TP 2, PP 2
    # (a pipeline of 2 runs 4 microbatches of 1: 4 sequences per step) x 2 policies = 6 layouts. GPUs of 1.6 MiB:
    # llama-tiny's pipeline layouts fit, FSDP 2 and TP 2 with full checkpointing do not (their peaks are 1.7 and 1.9
    # MiB), which settles the same meshes without checkpointing: 4 simulated, 2 settled.
    form.get_by_role("spinbutton", name="GPUs in all").fill("2")
    form.get_by_role("textbox", name="Memory per GPU").fill("1.6MiB")
    form.get_by_role("spinbutton", name="Global batch (sequences per optimizer step)").fill("4")
    form.get_by_role("spinbutton", name="GPUs per node").fill("2")
    page.evaluate(SAMPLE)
    form.get_by_role("button", name="Plan the layouts").click()
    table = page.locator('[data-testid="stTable"]').filter(has_text="Tokens/s per GPU (estimate)")
    table.wait_for(timeout=300_000)
    page.evaluate("() => { window.__stop = true; }")
    seen = page.evaluate("() => window.__progress")
    assert any(re.search(r"Simulated \d of [4-6] layouts", text) for text in seen), f"no progress seen: {seen[:5]}"
    rows = table.evaluate("t => [...t.querySelectorAll('tbody tr')].map(r => [...r.cells].map(c => c.innerText))")
    labels = [row[1] for row in rows]
    # TP runs with sequence parallel where the model takes it (llama-tiny does): "TP 2 + SP".
    assert sorted(labels) == sorted(["PP 2, none, microbatch 1", "PP 2, full, microbatch 1",
                                     "TP 2 + SP, full, microbatch 1", "FSDP 2, full, microbatch 1"]), rows
    fits = [row[3] for row in rows]
    assert fits == ["yes", "yes", "no", "no"], rows  # fitting layouts first
    assert all(row[2].endswith("MiB") for row in rows), rows  # peaks in a unit, not raw bytes
    page.get_by_text("4 layouts simulated").wait_for(timeout=10_000)
    page.get_by_text("Settled or refused without a run: 2").click()
    page.get_by_text("does not fit: full checkpointing at microbatch 1 already peaks").first.wait_for(timeout=10_000)
    chart = page.locator('[data-testid="stVegaLiteChart"]').filter(has=page.locator("canvas, svg")).last
    chart.wait_for(timeout=30_000)
    assert chart.bounding_box()["width"] > 300
    chart.scroll_into_view_if_needed()
    page.wait_for_timeout(800)
    both_sizes(page, tmp_path / "plan", full_page=True)


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_a_plan_shows_its_progress_with_a_cancel_button_that_stops_it(page, streamlit_url, tmp_path):
    """The default plan (8 GPUs, 1 or 2 pipeline stages, none and full checkpointing: over a minute of simulations
    here) runs as the server's other long work does: a line naming it, a bar with the layouts done, a Cancel button.
    Cancel stops it and says so with a button to run it again; the page keeps serving (page errors fail)."""
    page.goto(f"{streamlit_url}/parallel?preset=llama-tiny")
    page.get_by_text("Rank 0 next to one device").wait_for(timeout=180_000)
    open_tab(page, "Plan")
    form = page.locator('[data-testid="stForm"]').filter(has_text="GPUs in all")
    submit(page, form.get_by_role("button", name="Plan the layouts"), page.get_by_text("The plan of llama on 8 GPUs…"))
    page.locator('[data-testid="stProgress"]').filter(has_text=re.compile(r"Simulated \d+ of \d+ layouts")).wait_for(
        timeout=120_000)
    page.get_by_role("button", name="Cancel").scroll_into_view_if_needed()
    both_sizes(page, os.path.join(os.environ.get("GRAPHVIZ_CORE_SHOTS") or str(tmp_path), "plan-running"))
    page.get_by_role("button", name="Cancel").click()
    page.get_by_text("Cancelled: the plan of llama on 8 GPUs.").wait_for(timeout=30_000)
    page.get_by_role("button", name="Run again").wait_for(timeout=10_000)
    assert page.locator('[data-testid="stTable"]').filter(has_text="Tokens/s per GPU (estimate)").count() == 0
    page.get_by_role("tab", name="Memory per rank").click()  # the page still serves its other tabs
    page.get_by_text("Rank 0 next to one device").wait_for(timeout=30_000)
