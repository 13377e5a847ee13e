"""While a page recomputes (a new capture, a new simulation), what the last run showed is dimmed at once: it stood under
the progress line undimmed (Streamlit fades stale elements only ~1 s into a run, over another second)."""

import pytest

from graphviz_core.ui.browser_harness import serve_app
from tests.conftest import idle

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def streamlit_url(tmp_path_factory):
    """A server of this file's own: whether a rerun is quick (its capture still cached) must depend on this file's steps
    only. On the session's shared server, captures that earlier files' pages started can still be running and fill the
    shared cache (least recently used out first); the quick-rerun check failed there once in a fresh-clone run and
    never alone or under a CPU load."""
    with serve_app({"GRAPHVIZ_CORE_DEVICE": "cpu"}, log=tmp_path_factory.mktemp("stale") / "server.log") as url:
        yield url

# Every frame while the page shows its progress (a capture's Cancel box, the simulation's spinner): the most opaque
# element left from the last run. Installed before the click, read after the page is done.
SAMPLE = """(always) => {
  window.__stale = [];
  window.__dimmedByUs = false;
  window.__stopSampling = false;
  const busy = () => always || document.querySelector('[data-testid="stSpinner"]') !== null ||
    [...document.querySelectorAll('[data-testid="stButton"] button')].some(b => b.innerText.trim() === "Cancel");
  (function tick() {
    if (busy()) {
      const stale = [...document.querySelectorAll('[data-stale="true"]')].filter(e => e.offsetHeight > 0);
      if (stale.length) { window.__stale.push(Math.max(...stale.map(e => +getComputedStyle(e).opacity))); }
    }
    if ([...document.querySelectorAll('span[hidden]')].some(e => e.textContent === "recomputing")) {
      window.__dimmedByUs = true;  // ui.state.dim_stale_results' rule is on the page
    }
    if (!window.__stopSampling) { requestAnimationFrame(tick); }
  })();
}"""
DIMMED = 0.33  # ui.state.DIM_STALE's opacity; Streamlit's own fade reaches it only ~2 s into a run


def stale_opacities(page) -> list[float]:
    page.evaluate("() => { window.__stopSampling = true; }")
    return page.evaluate("window.__stale")


def test_beyond_one_gpu_dims_the_last_layout_while_it_simulates_a_new_one(page, streamlit_url):
    page.goto(f"{streamlit_url}/parallel")
    page.get_by_text("Rank 0 next to one device").wait_for(timeout=120_000)
    idle(page, 120_000, settle_ms=500)  # the run is over and no other follows it
    sidebar = page.locator('[data-testid="stSidebar"]')
    sidebar.get_by_role("spinbutton", name="World size (GPUs)").fill("6")  # no other test simulates it: not cached
    page.evaluate(SAMPLE, False)
    sidebar.get_by_role("button", name="Simulate ranks").click()
    page.get_by_text("over 6 ranks").first.wait_for(timeout=120_000)
    idle(page, 120_000, settle_ms=500)
    seen = stale_opacities(page)
    assert seen, "the simulation's progress was never seen beside the last result"
    assert max(seen) <= DIMMED + 0.01, f"the last layout's figures stood at opacity {max(seen):.2f} under the progress"


def test_the_explorer_dims_the_last_config_while_it_captures_a_new_one(page, streamlit_url):
    page.goto(streamlit_url)
    page.get_by_text("Loss ").first.wait_for(timeout=120_000)
    idle(page, 120_000, settle_ms=500)
    sidebar = page.locator('[data-testid="stSidebar"]')
    # No other test's config: not cached. Its progress shows from 0.3 s (capture_cache.QUIET_S) until the capture ends:
    # 64 layers took ~0.4 s on a quiet machine, the progress on screen for 4-8 frames, and a fresh-clone run once saw
    # none; 128 layers keep it there for 25-30 frames quiet, ~100 with both cores busy (23 layers: 0.23 s, never seen)
    sidebar.get_by_role("spinbutton", name="Layers").fill("128")
    page.evaluate(SAMPLE, False)
    sidebar.get_by_role("button", name="Run backward pass").click()
    page.get_by_text("gpt2 · 128 layers").first.wait_for(timeout=120_000)
    idle(page, 120_000, settle_ms=500)
    seen = stale_opacities(page)
    assert seen, "the capture's progress was never seen beside the last result"
    assert max(seen) <= DIMMED + 0.01, f"the last config's figures stood at opacity {max(seen):.2f} under the progress"
    assert page.evaluate("window.__dimmedByUs")  # the rule that dimmed it is the page's own
    # the next run is a quick one (another tab, the capture at hand): the page does not dim it. Streamlit's own fade
    # may, on a loaded machine where the rerun takes over a second: the rule's presence is what is checked.
    page.evaluate(SAMPLE, True)
    page.get_by_role("tab", name="Memory").click()
    page.get_by_text("Activation peak").wait_for(timeout=60_000)
    idle(page, 120_000, settle_ms=500)
    stale_opacities(page)
    assert not page.evaluate("window.__dimmedByUs")


def test_compare_dims_the_last_pair_while_it_captures_a_new_one(page, streamlit_url):
    # a seed no other test uses (not cached), 48 layers: batch 8 captured in 0.83 s on one torch thread here, so its
    # progress shows (from 0.3 s); 16 layers took 0.25 s, done before the progress could show (failed once so)
    page.goto(f"{streamlit_url}/compare?a.seed=4242&a.layers=48&b.seed=4242&b.layers=48&b.attention=manual")
    page.get_by_text("What changed, and why").wait_for(timeout=120_000)
    idle(page, 120_000, settle_ms=500)
    page.evaluate(SAMPLE, False)
    page.get_by_role("button", name="Batch 1 vs 8").click()
    page.get_by_text("Config B: gpt2-tiny").or_(page.get_by_text("b=8")).first.wait_for(timeout=120_000)
    idle(page, 120_000, settle_ms=500)
    seen = stale_opacities(page)
    assert seen, "the captures' progress was never seen beside the last comparison"
    assert max(seen) <= DIMMED + 0.01, f"the last pair's figures stood at opacity {max(seen):.2f} under the progress"
