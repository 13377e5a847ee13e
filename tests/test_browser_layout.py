"""The explorer's headline at laptop and desktop widths: every metric's label, value and note whole (each page loaded
at a laptop's size, then looked at again at a desktop's)."""

import pytest

from graphviz_core.ui.browser_harness import graph_frame
from tests.conftest import LAPTOP, SIDEBAR_INPUTS, at_laptop, captured, cut_off, each_size, idle

pytestmark = pytest.mark.browser

# Every label, value and note of a metric (cut_off: a visible one whose text is wider than its box): Streamlit cuts such text
# with an ellipsis ("28 te…", "677.8 …" at 1280 px when six metrics shared one row), so nobody reads it.
METRIC_TEXTS = '[data-testid="stMetric"] [data-testid="stMarkdownContainer"]'
TABS = {"Memory": "Peak memory", "FLOPs and time": "Forward FLOPs"}  # tab -> a metric only that tab shows


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_every_headline_metric_is_shown_whole(page, streamlit_url, tmp_path):
    page.goto(streamlit_url)
    capture = captured("gpt2-tiny")
    graph_frame(page, capture.summary.nodes)
    # Streamlit may redraw the page once more when the first script run ends: wait for the headline
    page.wait_for_function("() => document.querySelectorAll('[data-testid=\"stMetric\"]').length >= 6", timeout=30_000)
    idle(page, 30_000)
    metrics = page.locator('[data-testid="stMetric"]')
    texts = metrics.all_inner_texts()
    # the values the page must show whole: these are the capture's own figures, formatted as the page does
    assert any(f"{capture.summary.parameter_count:,}" in t for t in texts), texts
    assert any("Saved for backward" in t for t in texts), texts
    for size in each_size(page):
        page.screenshot(path=str(tmp_path / f"explorer-{size}.png"))
        assert cut_off(page.locator(METRIC_TEXTS)) == [], f"headline cut off at {size}"
    for tab, metric in TABS.items():  # each panel's own metrics, once its tab is drawn
        at_laptop(page)
        page.get_by_role("tab", name=tab).click()
        page.locator('[data-testid="stMetricLabel"]', has_text=metric).wait_for(timeout=60_000)
        page.wait_for_timeout(500)
        for size in each_size(page):
            assert cut_off(page.locator(METRIC_TEXTS)) == [], f"{tab} metrics cut off at {size}"


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_the_compare_pages_metrics_are_shown_whole(page, streamlit_url):
    # Five metrics in one row cut the notes off at 1440 px ("-442.4 kFLOP vs A 37.2 MFL…").
    page.goto(f"{streamlit_url}/compare")
    page.get_by_role("button", name="Fused vs spelled-out attention").click()
    page.locator('[data-testid="stMetricLabel"]', has_text="Nodes per layer").wait_for(timeout=120_000)
    idle(page)
    page.wait_for_timeout(500)
    labels = page.locator('[data-testid="stMetricLabel"]').all_inner_texts()
    assert "Backward FLOPs (B)" in labels and "Forward + backward time (B)" in labels, labels
    for size in each_size(page):
        assert cut_off(page.locator(METRIC_TEXTS)) == [], f"compare metrics cut off at {size}"


@pytest.mark.parametrize("page", [LAPTOP], indirect=True)
def test_the_sidebar_shows_every_chosen_value_whole(page, streamlit_url):
    # the longest choices of each box: bfloat16, the family's selective policy, the preset box's "custom" entry
    page.goto(f"{streamlit_url}/?preset=gpt2-tiny&dtype=bfloat16&checkpoint=selective")
    page.locator('[data-testid="stMetricLabel"]', has_text="Nodes").first.wait_for(timeout=120_000)
    values = page.evaluate("() => [...document.querySelectorAll('[data-testid=\"stSidebar\"] input')].map(e => e.value)")
    assert "bfloat16" in values and any(v.startswith("selective") for v in values), values
    assert "(custom: the fields below)" in values, values
    for size in each_size(page):
        # no text box or select whose value is wider than the box (the dtype box read "bfloat1…")
        assert cut_off(page.locator(SIDEBAR_INPUTS)) == [], f"sidebar values cut off at {size}"


@pytest.mark.parametrize("page", [(1280, 800)], indirect=True)
def test_the_parallel_pages_sidebar_shows_every_chosen_value_whole(page, streamlit_url):
    # The strategy box read "FSDP (shard every lay" inside an expander at 1280x800.
    page.goto(f"{streamlit_url}/parallel")
    page.locator('[data-testid="stMetricLabel"]').first.wait_for(timeout=120_000)
    # the page's own form under the config form: drawn once its run is over (a fresh-clone run read the sidebar
    # before it was, every config field there and no Strategy box yet)
    page.locator('[data-testid="stSidebar"]').get_by_role("combobox", name="Strategy", exact=True).wait_for(
        timeout=60_000)
    idle(page)
    values = page.evaluate("() => [...document.querySelectorAll('[data-testid=\"stSidebar\"] input')].map(e => e.value)")
    assert "FSDP" in values, values
    assert cut_off(page.locator(SIDEBAR_INPUTS)) == []
