"""The form's "Mixed precision (autocast)" and "Optimizer" controls in Chromium: picking bfloat16 and Adafactor runs
that step (the graph gains autocast's cast nodes), the config line and the address bar name both, and the Memory tab's
training step names the optimizer and shows the weight copies (page errors fail the test)."""

from urllib.parse import parse_qs, urlparse

import pytest

from graphviz_core.ui.browser_harness import graph_frame
from tests.conftest import LAPTOP, both_sizes, captured, choose, idle

pytestmark = pytest.mark.browser


def _pick(page, label: str, option: str) -> None:
    choose(page, page.locator('[data-testid="stSidebar"]').get_by_role("combobox", name=label, exact=True), option)


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_autocast_and_optimizer_controls_run_that_step(page, streamlit_url, tmp_path):
    fp32 = captured("llama-tiny")
    mixed = captured("llama-tiny", autocast="bfloat16", optimizer="adafactor")
    page.goto(f"{streamlit_url}/?preset=llama-tiny")
    graph_frame(page, fp32.summary.nodes, timeout_s=120)
    idle(page)
    _pick(page, "Mixed precision (autocast)", "bfloat16")
    _pick(page, "Optimizer", "Adafactor")
    page.locator('[data-testid="stSidebar"]').get_by_role("button", name="Run backward pass").click()
    # 31 cast nodes more than the fp32 graph (tests/test_autocast.py counts them with its own walk)
    assert mixed.summary.nodes == fp32.summary.nodes + 31
    graph_frame(page, mixed.summary.nodes, timeout_s=120)
    line = page.locator('[data-testid="stCaptionContainer"]').filter(has_text="bfloat16 autocast")
    line.first.wait_for(timeout=30_000)
    assert "Adafactor optimizer" in line.first.inner_text()
    query = parse_qs(urlparse(page.url).query)
    assert query.get("autocast") == ["bfloat16"] and query.get("optimizer") == ["adafactor"], page.url
    both_sizes(page, tmp_path / "autocast-graph", full_page=True)

    page.get_by_role("tab", name="Memory").click()
    page.get_by_text("One training step (Adafactor, bfloat16 autocast)").wait_for(timeout=60_000)
    page.get_by_text("bfloat16 weight copies", exact=True).wait_for(timeout=10_000)
    page.get_by_text("Adafactor: col_var", exact=False).first.wait_for(timeout=10_000)
    page.get_by_text("One training step").scroll_into_view_if_needed()
    both_sizes(page, tmp_path / "autocast-memory", full_page=False)
