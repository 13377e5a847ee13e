"""The sidebar's Checkpointing box offers torchtitan's own policy, clicked in Chromium: choosing
`selective-ops-torchtitan` and pressing Run draws that capture's graph, the address bar names it, the box shows the
whole name, and the Memory tab's side-by-side table explains its row (page errors fail the test)."""

from urllib.parse import parse_qs, urlparse

import pytest

from graphviz_core.ui.browser_harness import graph_frame
from tests.conftest import LAPTOP, SIDEBAR_INPUTS, both_sizes, captured, choose, cut_off

pytestmark = pytest.mark.browser

POLICY = "selective-ops-torchtitan"


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_choosing_torchtitans_policy_runs_it(page, streamlit_url, tmp_path):
    plain, titan = captured("llama-tiny"), captured("llama-tiny", checkpoint=POLICY)
    page.goto(f"{streamlit_url}/?preset=llama-tiny")
    graph_frame(page, plain.summary.nodes, timeout_s=120)
    sidebar = page.locator('[data-testid="stSidebar"]')
    choose(page, sidebar.get_by_role("combobox", name="Checkpointing", exact=True), POLICY)
    sidebar.get_by_role("button", name="Run backward pass").click()
    # the config line names the policy once its capture is drawn (checkpointing keeps the graph's node count)
    assert titan.summary.nodes == plain.summary.nodes
    page.locator('[data-testid="stCaptionContainer"]').filter(has_text=f"checkpoint {POLICY}").first.wait_for(
        timeout=120_000)
    graph_frame(page, titan.summary.nodes, timeout_s=120)
    assert parse_qs(urlparse(page.url).query).get("checkpoint") == [POLICY], page.url
    values = page.evaluate("() => [...document.querySelectorAll('[data-testid=\"stSidebar\"] input')].map(e => e.value)")
    assert POLICY in values, values
    assert cut_off(page.locator(SIDEBAR_INPUTS)) == [], f"sidebar values cut off at {page.size}"
    sidebar.get_by_text("Checkpointing", exact=True).scroll_into_view_if_needed()
    both_sizes(page, tmp_path / "torchtitan-sidebar", full_page=False)
    page.get_by_role("tab", name="Memory").click()
    page.get_by_role("button", name="Compare the checkpointing policies").click()
    # the table's caption explains each row by its policy's own sentence
    note = page.get_by_text(f"{POLICY}: torchtitan's op-level selective activation checkpointing exactly")
    note.first.wait_for(timeout=120_000)
    note.first.scroll_into_view_if_needed()
    both_sizes(page, tmp_path / "torchtitan-memory", full_page=False)
