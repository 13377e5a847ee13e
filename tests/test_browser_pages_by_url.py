"""Each page opened by its own URL connects to the server with no failed request on the way (graphviz_core.ui.routes):
Streamlit's frontend probed `/<page>/_stcore/health` and `/<page>/_stcore/host-config` first, two 404s a page that the
browser logs as console errors."""

from urllib.parse import urlparse

import pytest

pytestmark = pytest.mark.browser

PAGES = {
    "compare": "Compare two configs",
    "parallel": "Beyond one GPU",
    "recordings": "Recordings of your own training loop",
    "toy_expressions": "Backprop, one value at a time",
}


# graphviz_core.ui.serve's main() installs graphviz_core.ui.routes before `streamlit run`, as `make run` starts it.
@pytest.mark.parametrize("path", list(PAGES))
def test_a_page_opened_by_its_url_requests_nothing_that_fails_and_still_navigates(page, streamlit_url, path):
    probes, failed = [], []
    page.on("request", lambda r: probes.append(r.url) if "/_stcore/" in r.url and f"/{path}/" in r.url else None)
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.goto(f"{streamlit_url}/{path}")
    page.get_by_role("heading", name=PAGES[path]).wait_for(timeout=60_000)
    assert probes == [] and failed == [], (probes, failed)
    # connected at the server's root: moving to another page in the app and back works as from the front page
    nav = page.locator('[data-testid="stSidebarNav"]')
    nav.get_by_text("Graph explorer").click()
    page.get_by_role("heading", name="Inside the backward pass").wait_for(timeout=60_000)
    assert urlparse(page.url).path == "/"
    nav.get_by_text({"compare": "Compare two configs", "parallel": "Beyond one GPU",
                     "recordings": "Recordings", "toy_expressions": "Toy expressions"}[path]).click()
    page.get_by_role("heading", name=PAGES[path]).wait_for(timeout=60_000)
    assert urlparse(page.url).path == f"/{path}"
    assert failed == [], failed
    page.goto("about:blank")  # before the next test: the page's running script would be cut off mid-run
