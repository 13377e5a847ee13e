"""Shared fixtures: captures are expensive enough to share within a test session."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import settings

from graphviz_core.capture.engine import capture_backward
from graphviz_core.capture.result import Capture
from graphviz_core.config import FAMILIES, config_from_preset
from graphviz_core.models.transformers_family import TransformersFamily
from graphviz_core.ui.browser_harness import NO_RUN

# Hypothesis times each example against a deadline (200 ms by default): on a loaded machine a first example (a first
# pyarrow conversion) took 251 ms and failed as "unreliable timings". Speed is measured in benchmarks/, never in a
# test, so no example has a deadline.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

# The families built by Hugging Face `transformers` (the rest are built in, or the user's own module).
HF_FAMILIES = tuple(name for name, family in FAMILIES.items() if isinstance(family, TransformersFamily))


@functools.lru_cache(maxsize=64)
def captured(preset: str, **overrides) -> Capture:
    """One capture per (preset, overrides) for the whole test session."""
    return capture_backward(config_from_preset(preset, **overrides))


def plain(markdown: str) -> str:
    """What the reader sees of escaped Markdown (text is backslash-escaped before it is shown)."""
    return re.sub(r"\\(.)", r"\1", markdown).replace("\u2060", "")


def tables(at) -> list:
    """The page's st.table frames as the reader sees them: their cells are escaped (graphviz_core.ui.format.literal_cells),
    since st.table renders Markdown."""
    def shown(value):
        return plain(value) if isinstance(value, str) else value

    frames = []
    for table in at.table:
        frame = table.value.map(shown)
        frame.index = frame.index.map(shown)
        frame.columns = frame.columns.map(shown)
        frames.append(frame)
    return frames


# 'auto' means CPU in tests unless a test says otherwise (a GPU box runs the same numbers): for the whole session
# too, since module-scoped fixtures run before any test's own fixtures (on an H200 the pipeline fixtures simulated
# CUDA's attention kernels, and their hand-derived activation bytes read 340,480 where this CPU's are 292,352).
os.environ["GRAPHVIZ_CORE_DEVICE"] = "cpu"


@pytest.fixture(autouse=True)
def _cpu_unless_asked(monkeypatch):
    monkeypatch.setenv("GRAPHVIZ_CORE_DEVICE", "cpu")


# A capture whose timed thread shares the interpreter: gpt2-tiny at batch 8, sequence 64 (a 15-26 ms forward). At its
# preset's sizes (a 2.2 ms forward) a full suite's run read a CPU share of 0.9999 beside a spinning thread: the machine's
# other processes kept the spinner off the cores for the whole forward.
SHARED_CAPTURE = {"name": "gpt2-tiny", "device": "cpu", "seed": 11, "batch": 8, "seq": 64}


@contextlib.contextmanager
def python_threads_spinning(count: int = 1, switch_interval_s: float = 1e-4):
    """`count` threads running pure Python while the block runs, each already spinning when it starts, and the
    interpreter lock handed over every `switch_interval_s` (Python's own 5 ms made a capture wait 6 s while each of its
    hooks waited its turn). With one spinner, 40 captures of SHARED_CAPTURE beside three busy processes ran for
    0.19-0.54 of their wall time, each in about 0.1 s."""
    stop = threading.Event()
    started = [threading.Event() for _ in range(count)]

    def spin(started: threading.Event) -> None:
        started.set()
        while not stop.is_set():
            sum(range(100))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_s)
    spinners = [threading.Thread(target=spin, args=(event,), daemon=True) for event in started]
    try:
        for thread in spinners:
            thread.start()
        for event in started:
            event.wait()
        yield
    finally:
        stop.set()
        for thread in spinners:
            thread.join()
        sys.setswitchinterval(interval)


# ---- browser tests: a live Streamlit server and headless Chromium ------------------------------------


@pytest.fixture(scope="session")
def streamlit_url(tmp_path_factory):
    """`streamlit run app.py` on a free localhost port, for the whole session; its stderr in server.log under
    pytest's temporary folder (kept after the run: /tmp/pytest-of-<user>/pytest-<n>/app*/)."""
    from graphviz_core.ui.browser_harness import serve_app

    with serve_app({"GRAPHVIZ_CORE_DEVICE": "cpu"}, log=tmp_path_factory.mktemp("app") / "server.log") as url:
        yield url


@pytest.fixture(scope="session")
def _playwright():
    """One Playwright driver per worker: its sync API runs one call at a time, so the browser and the warm profile
    below share it."""
    from graphviz_core.ui.browser_harness import CHROMIUM

    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="session")
def browser(_playwright):
    """Chromium with no profile: each context from it is a stranger's browser (own cookies, empty cache)."""
    from graphviz_core.ui.browser_harness import CHROMIUM, CHROMIUM_ARGS

    b = _playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield b
    b.close()


@pytest.fixture(scope="session")
def warm_profile(_playwright, tmp_path_factory):
    """Chromium with a profile on disk, one per worker, in which each test's `page` is a new tab: as a person
    reopening the app, it keeps Streamlit's scripts in its HTTP cache and their compiled code (V8's code cache, which
    a profile-less context never keeps). A page load then costs about 2.1 CPU s of the machine instead of 3.0 (six
    loads each way, one run); the browser files' CPU fell by a fifth. Each tab is still its own Streamlit session."""
    from graphviz_core.ui.browser_harness import CHROMIUM, CHROMIUM_ARGS

    context = _playwright.chromium.launch_persistent_context(
        tmp_path_factory.mktemp("chromium-profile"), executable_path=CHROMIUM,
        args=[*CHROMIUM_ARGS, "--process-per-site"], viewport={"width": 1500, "height": 1000})
    with _anchor_page() as url:
        anchor = context.pages[0] if context.pages else context.new_page()
        anchor.goto(url)
        yield context
        context.close()


@contextlib.contextmanager
def _anchor_page():
    """An empty page on 127.0.0.1, kept open in the warm profile's first tab for the whole session. With Chromium's
    --process-per-site every tab of one site shares one renderer process, and this tab keeps that process alive
    between tests, so each test's tab opens in a renderer whose JavaScript engine has already compiled Streamlit's
    scripts (ports do not count in a site: every test server on 127.0.0.1 is the same site). A load of the explorer:
    1.36 CPU s of the machine against 1.63 in a renderer of its own (five loads each way, one run). Served from a
    thread of this worker, so it needs no Streamlit server."""
    import http.server

    class Empty(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<!doctype html><title>anchor</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Empty)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _console_error(message) -> str | None:
    """A console error as a line, or None for messages that are not errors."""
    if message.type != "error":
        return None
    location = message.location or {}
    return f"console error: {message.text} ({location.get('url', '')[:120]}:{location.get('lineNumber', '')})"


@pytest.fixture
def page(warm_profile, request):
    """A new tab in the worker's warm profile that fails the test on any page error or console error. The page's
    `request` events still fire for what the cache answers (a tab's listing of the files it asks for stays whole).

    Playwright reports `pageerror` (uncaught exceptions) and `console` messages for the page and every frame
    in it, so errors thrown inside the graph's iframe (st.iframe, srcdoc) are caught here too: any error fails the
    test.
    """
    # the window size: 1500x1000 unless a test parametrizes it (`@pytest.mark.parametrize("page", [(w, h)],
    # indirect=True)`; SIZES holds the two every layout is checked at)
    with watched_tab(warm_profile, *getattr(request, "param", (1500, 1000))) as pg:
        yield pg


@pytest.fixture
def second_page(browser):
    """Another person: a browser context of its own (own cookies, own Streamlit session), errors failing the test."""
    with watched_page(browser) as pg:
        yield pg


SIZES = ((1280, 800), (1920, 1080))  # a laptop's and a desktop's window
LAPTOP = SIZES[0]  # where a click-through runs (the narrower: a control cut off or out of reach shows here first)


# The page's layout read in the page: the size and place of the main block, the sidebar, columns, tables and their grids,
# charts and frames, and the document's scroll size.
_SETTLED = """([stableMs, capMs]) => new Promise(done => {
  const parts = '[data-testid="stMainBlockContainer"], [data-testid="stSidebar"], [data-testid="stHorizontalBlock"], '
    + '[data-testid="stDataFrame"], [data-testid="stTable"], [data-testid="stVegaLiteChart"], iframe, canvas';
  const layout = () => {
    const sizes = [document.documentElement.scrollWidth, document.documentElement.scrollHeight];
    for (const el of document.querySelectorAll(parts)) {
      const box = el.getBoundingClientRect();
      sizes.push(Math.round(box.x), Math.round(box.y), Math.round(box.width), Math.round(box.height));
    }
    return sizes.join(",");
  };
  const start = performance.now();
  let seen = layout(), since = start;
  const look = () => {
    const now = performance.now(), current = layout();
    if (current !== seen) { seen = current; since = now; }
    if (now - since >= stableMs || now - start >= capMs) done(); else setTimeout(look, 50);
  };
  setTimeout(look, 50);
})"""


def settled(page, stable_ms: int = 300, cap_ms: int = 3000) -> None:
    """Wait until the page's layout (_SETTLED) has not changed for `stable_ms`, or `cap_ms` at most. After a resize
    Streamlit's columns, data grids and charts were laid out again within 250 ms of the new size in 76 resizes of eight
    browser test files (most within 150 ms; the last change came later only on pages still running their script),
    where a fixed 800 ms wait was kept before: a run resizes about 110 times."""
    page.evaluate(_SETTLED, [stable_ms, cap_ms])


def _resize(page, width: int, height: int) -> None:
    """The window at width x height, once Streamlit has laid its columns out again for it (nothing when it is)."""
    if page.viewport_size != {"width": width, "height": height}:
        page.set_viewport_size({"width": width, "height": height})
        settled(page)


def each_size(page, first: tuple[int, int] = LAPTOP):
    """Each of SIZES in turn, `first` first, on the page as it stands: one load looked at at both widths, as a
    person resizing the window sees it. Yields the size as "WxH"."""
    for width, height in sorted(SIZES, key=lambda size: size != first):
        _resize(page, width, height)
        yield f"{width}x{height}"


def both_sizes(page, path, full_page: bool = False) -> None:
    """Screenshots of the page as it stands at each of SIZES, `path` plus "-1280x800.png" and "-1920x1080.png", then
    back to the page's own size: a flow clicked through once, at a laptop's size, is looked at at both."""
    own = page.viewport_size
    for size in each_size(page, first=(own["width"], own["height"])):
        page.screenshot(path=f"{path}-{size}.png", full_page=full_page)
    _resize(page, own["width"], own["height"])


def at_laptop(page) -> None:
    """Back to a laptop's window before the next page is loaded."""
    page.set_viewport_size({"width": LAPTOP[0], "height": LAPTOP[1]})


def idle(page, timeout_ms: int = 60_000, settle_ms: int = 0) -> None:
    """Wait until the app has no script run in progress; with `settle_ms`, until it has stayed so that long (a run
    can follow the one that just ended: the address bar's sync)."""
    deadline = time.monotonic() + timeout_ms / 1000
    while True:  # looked at every 100 ms: by default Playwright looks at every animation frame, which keeps the page
        # drawing frames the whole wait (8 s of waiting: 0.7 CPU s of the machine, 0.1-0.4 this way)
        page.wait_for_function(NO_RUN, timeout=max(1, int((deadline - time.monotonic()) * 1000)), polling=100)
        if not settle_ms:
            return
        page.wait_for_timeout(settle_ms)
        if page.evaluate(NO_RUN):
            return


# Of the elements given, each whose text (an input's value) is wider than its box: cut off at its edge or hidden behind
# Streamlit's ellipsis, so nobody reads it whole. Elements not laid out (a closed tab) count as whole.
_CUT_OFF = """elements => elements.filter(e => e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1)
    .map(e => e instanceof HTMLInputElement ? e.value : e.textContent.trim())"""


SIDEBAR_INPUTS = '[data-testid="stSidebar"] input'  # every text box and select in the sidebar


def cut_off(elements) -> list[str]:
    """The texts of `elements` (a Playwright locator) that are cut off (_CUT_OFF); [] when every one reads whole."""
    return elements.evaluate_all(_CUT_OFF)


def table_rows(page, table, rows: int, timeout_ms: int = 30_000) -> list[list[str]]:
    """The text of every cell of each body row of `table` (an st.table's locator), read in one go once it has `rows`
    rows and the app has no run in progress. Read row by row, a read straddled Streamlit drawing the table again (a
    fresh-clone run read row 0 with no cells while row 1 was whole)."""
    table.locator("tbody tr").nth(rows - 1).wait_for(timeout=timeout_ms)
    idle(page, settle_ms=300)
    return table.evaluate("t => [...t.querySelectorAll('tbody tr')].map(r => [...r.cells].map(c => c.innerText))")


def submit(page, button, shows, tries: int = 3, timeout_ms: int = 20_000) -> None:
    """Press a form's submit `button` once the app is idle and wait for `shows` (a locator: what the press brings);
    press again if it did not come. Two fresh-clone runs each lost one press of the Plan tab's "Plan the layouts":
    neither its refusal nor its plan ever showed. The tab draws its form in the rerun its click starts, and a press
    landing while that rerun still draws went nowhere."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(tries):
        idle(page, settle_ms=300)
        button.click()
        try:
            shows.first.wait_for(timeout=timeout_ms)
            return
        except PlaywrightTimeout:
            if attempt == tries - 1:
                raise


def open_tab(page, name: str) -> None:
    """Click the tab `name` and wait until the rerun that draws it has ended (the open tab is a query parameter: only
    it is drawn)."""
    page.get_by_role("tab", name=name).click()
    idle(page, settle_ms=300)


def choose(page, box, option: str, tries: int = 4) -> None:
    """Pick `option` in the selectbox whose combobox is `box`, as a person does: once the app is idle, focus the box,
    open its list (ArrowDown: in a sidebar form a click alone sometimes left it closed) and click the option; open it
    again if a rerun still drawing (the address bar's sync after a run) closed the list before the click."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    wanted = page.get_by_role("option", name=option, exact=True)
    for attempt in range(tries):
        idle(page)
        box.click()
        box.press("ArrowDown")
        try:
            wanted.click(timeout=10_000)
            return
        except PlaywrightTimeout:
            if attempt == tries - 1:
                raise
            page.keyboard.press("Escape")


@contextlib.contextmanager
def watched_page(browser, width: int = 1500, height: int = 1000):
    """A page in a new browser context; on leaving, the context is closed and any page or console error fails."""
    context = browser.new_context(viewport={"width": width, "height": height})
    try:
        with _watched(context.new_page(), width, height) as pg:
            yield pg
    finally:
        context.close()


@contextlib.contextmanager
def watched_tab(context, width: int = 1500, height: int = 1000):
    """A new tab in `context` (the warm profile); on leaving, the tab is closed and any page or console error fails."""
    pg = context.new_page()
    if pg.viewport_size != {"width": width, "height": height}:
        pg.set_viewport_size({"width": width, "height": height})
    try:
        with _watched(pg, width, height):
            yield pg
    finally:
        pg.close()


@contextlib.contextmanager
def _watched(pg, width: int, height: int):
    pg.size = f"{width}x{height}"
    errors: list[str] = []
    pg.on("pageerror", lambda error: errors.append(f"page error: {error}"))
    pg.on("console", lambda message: errors.append(line) if (line := _console_error(message)) else None)
    pg.errors = errors  # tests may assert on it mid-way; teardown asserts it stayed empty
    yield pg
    assert not errors, f"the page ({pg.size}) logged errors:\n" + "\n".join(errors)


EXPLORER = str(Path(__file__).resolve().parent.parent / "app.py")


def explorer_tab(tab: str, timeout: int = 120, **params: str):
    """The explorer run once under AppTest with `tab` open (only the open tab is drawn; the tab is the ?tab= query
    parameter) and any other query parameters (`preset="resnet-tiny"`)."""
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(EXPLORER, default_timeout=timeout)
    at.query_params["tab"] = tab
    for name, value in params.items():
        at.query_params[name] = value
    return at.run()


# ---- running in parallel: `make test` runs three pytest-xdist workers, one test file each at a time (--dist loadfile)


def pytest_collection_modifyitems(config, items):
    """Test files longest first by their time in a recorded run (tests/durations.py; a file not recorded counts as the
    longest), the README and docs commands (one file, its blocks sharing files under /tmp) before all. Under `-n 3
    --dist loadfile --no-loadscope-reorder` (make test) xdist hands the files out in this order, so the workers
    end within a short file of each other: xdist's own order, the files with most tests first, left the long
    single-test browser files to the end, where one worker ran them for 23 s after the other had finished."""
    from tests.durations import load

    seconds = load()

    def longest_first(item):
        name = item.path.name
        return (name != "test_docs_commands.py", -seconds.get(name, float("inf")))

    items.sort(key=longest_first)  # stable: a file's tests keep their order

