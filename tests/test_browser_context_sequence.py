"""Beyond one GPU's context-parallel and sequence-parallel controls clicked in Chromium: the layer's activations, the
hand count, Korthikanti et al.'s formula and the ring's key/value traffic, clicked at a laptop's size and
photographed at a desktop's too (page errors fail)."""

import pytest

from graphviz_core.ui.format import format_bytes
from tests.conftest import LAPTOP, both_sizes, table_rows

pytestmark = pytest.mark.browser


def _simulate(page):
    """Press Simulate ranks, open the new tab; its panel."""
    page.get_by_role("button", name="Simulate ranks").click()
    tab = page.get_by_role("tab", name="Context and sequence parallel")
    tab.wait_for(timeout=180_000)
    tab.click()
    return page.get_by_role("tabpanel").filter(has_text="Counted by hand")


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_context_then_sequence_parallel_from_the_form(page, streamlit_url, tmp_path):
    page.goto(f"{streamlit_url}/parallel?preset=llama-tiny")  # the page's default layout: FSDP over 8 ranks
    page.get_by_text("Rank 0 next to one device").wait_for(timeout=180_000)
    page.get_by_role("spinbutton", name="Context parallel (cp)").fill("2")
    panel = _simulate(page)
    # FSDP 8 = data 4 x context 2: 16 of 32 tokens per rank. One layer: norms 49,408 + attention 25,088 + SwiGLU
    # 65,536 + the ring output's copy 8,192 = 148,224 B (tests/test_context_sequence.py derives each term).
    page.get_by_text("each rank holds 16 of the 32 tokens").wait_for(timeout=30_000)
    metrics = panel.locator('[data-testid="stMetricValue"]')
    assert metrics.nth(0).inner_text() == metrics.nth(1).inner_text() == format_bytes(148_224)
    ring = panel.locator('[data-testid="stTable"]').filter(has_text="Sent by this rank (recorded)")
    # keys and values of 16 tokens: 2*2*16*32 float32 = 8 KiB; backward 8 KiB + 2 x 8 KiB of float32 gradients
    cells = [row[-2:] for row in table_rows(page, ring, 2)]  # drawn after the metrics (a CI run read no rows yet)
    assert cells == [
        [format_bytes(8_192), format_bytes(8_192)], [format_bytes(24_576), format_bytes(24_576)]]
    both_sizes(page, tmp_path / "cp", full_page=True)

    page.goto(f"{streamlit_url}/parallel?preset=llama-tiny&strategy=tp&world_size=2&tp=2")
    page.get_by_text("Rank 0 next to one device").wait_for(timeout=180_000)
    page.get_by_text("Sequence parallel (with TP)", exact=True).click()
    panel = _simulate(page)
    # Norms on 16 tokens 33,024 + gathered inputs 32,768 + attention 25,088 + SwiGLU 65,536 = 156,416 B; Korthikanti
    # et al. with sequence parallel, 16-bit: s·b·h/t·(34 + 5·a·s/h) = 2048 x 44 = 90,112 B.
    page.get_by_text("the norms run on 1/2 of the tokens").wait_for(timeout=30_000)
    metrics = panel.locator('[data-testid="stMetricValue"]')
    assert [metrics.nth(i).inner_text() for i in range(3)] == [
        format_bytes(156_416), format_bytes(156_416), format_bytes(90_112)]
    page.get_by_text("all-gathered inputs of the projections").wait_for(timeout=10_000)
    page.get_by_text("Fused attention (sdpa) keeps no a·s² score matrix").wait_for(timeout=10_000)
    both_sizes(page, tmp_path / "sp", full_page=True)
