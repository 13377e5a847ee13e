"""Serving for a team: the shipped Streamlit settings, user text shown literally, downloads that all arrive."""

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import tomllib

from graphviz_core.ui.browser_harness import graph_frame
from graphviz_core.ui.format import escape_markdown
from tests.conftest import captured

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "![x](http://example.com/t.png)"
LATEX = r"$\href{http://example.com/l}{click}$"


def test_the_shipped_settings_are_safe_for_a_shared_server():
    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "127.0.0.1"  # localhost unless the operator binds elsewhere
    assert config["server"]["headless"] is True
    assert config["server"]["enableXsrfProtection"] is True
    assert config["server"]["enableCORS"] is True  # Streamlit's "refuse cross-origin requests"
    assert config["server"]["maxUploadSize"] == 1
    assert config["browser"]["gatherUsageStats"] is False
    assert config["client"]["showErrorDetails"] == "none"
    # No full collection after every script run (Streamlit's default is one per run: it walked every capture kept)
    assert config["runner"]["postScriptGC"] is False
    makefile = (ROOT / "Makefile").read_text()
    serve = makefile[makefile.index("\nserve:") :]
    assert "--server.address $(HOST)" in serve and "HOST ?= 127.0.0.1" in makefile
    run = makefile[makefile.index("\nrun:") : makefile.index("\nserve:")]
    assert "--server.address 127.0.0.1" in run
    assert "-m graphviz_core.ui.serve" in run and "-m graphviz_core.ui.serve" in serve


def test_the_upload_limit_is_raised_only_where_the_recordings_page_takes_a_zip(monkeypatch):
    from graphviz_core.ui.serve import MAX_UPLOAD_BYTES, RECORDINGS_ENV, upload_options

    monkeypatch.delenv(RECORDINGS_ENV, raising=False)  # a person's own machine: the page's .zip box, 200 MiB
    assert upload_options(["--server.port", "8501"]) == ["--server.maxUploadSize", "200"]  # 200 x 2**20 B in MiB
    assert MAX_UPLOAD_BYTES == 200 * 2**20
    assert upload_options(["--server.maxUploadSize", "5"]) == []  # the operator's own choice stands
    assert upload_options(["--server.maxUploadSize=5"]) == []
    monkeypatch.setenv(RECORDINGS_ENV, "/srv/recordings")  # a team server: no upload box, config.toml's 1 MB
    assert upload_options([]) == []


def test_streamlit_reads_the_post_run_collection_off_from_the_shipped_settings():
    """The key is Streamlit's own (a misspelt one is ignored with a warning): parsed from .streamlit/config.toml in the
    repository root, where `make run` and `make serve` start, the option reads False (Streamlit's default is True)."""
    code = "from streamlit import config; print(config.get_option('runner.postScriptGC'))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
    elsewhere = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "docs", capture_output=True, text=True,
                               timeout=120)
    assert elsewhere.stdout.strip() == "True", elsewhere.stderr  # without the file: Streamlit's default


def test_the_launcher_preloads_the_first_graphs_modules_then_the_panels_after_the_first_capture():
    # `make run` starts graphviz_core.ui.serve: the same app, plus a background thread importing what the first
    # graph needs and paying the first capture's one-time costs before the first visitor arrives; the other
    # panels (pandas, Altair) only once a first capture is in, so the first graph never waits for them.
    script = (
        "import sys, threading, time\n"
        "from graphviz_core.ui import serve\n"
        "from graphviz_core.capture import engine as capture\n"
        "assert not any(name in sys.modules for name in (*serve.FIRST_GRAPH[1:], *serve.PANELS)) and not capture._WARMED\n"
        "serve.SERVER_UP_WAIT_S = 0  # no server here to let answer first (it waited its 5 s for one)\n"
        "serve.PANELS_SETTLE_S = 0.2  # the pause after the first capture, for its page to draw: none here\n"
        "preloading = threading.Thread(target=serve.preload)\n"
        "preloading.start()\n"
        "while not capture._WARMED.get('cpu'):\n"
        "    time.sleep(0.05)\n"
        "time.sleep(1.0)  # the thread now waits for a first capture\n"
        "first, early = all(n in sys.modules for n in serve.FIRST_GRAPH), any(n in sys.modules for n in serve.PANELS)\n"
        "from graphviz_core.config import config_from_preset\n"
        "from graphviz_core.serve.shared_captures import shared_captures\n"
        "job = shared_captures().request(config_from_preset('mlp', device='cpu'), 'test')\n"
        "job.done.wait(120)\n"
        "preloading.join(60)\n"
        "print(first, early, all(n in sys.modules for n in serve.PANELS))\n"
    )
    env = {**os.environ, "GRAPHVIZ_CORE_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    assert out.stdout.split() == ["True", "False", "True"], out.stderr[-2000:]


@pytest.mark.parametrize(
    ("typed", "shown"),
    [
        (IMAGE, r"\!\[x\]\(http⁠\:\/\/example\.com\/t\.png\)"),
        (LATEX, r"\$\\href\{http⁠\:\/\/example\.com\/l\}\{click\}\$"),
        ("a_b * c", r"a\_b \* c"),
        (":material/home:", r"\:material\/home\:"),
        ("www.x.org a@b.c", r"www⁠\.x\.org a\@⁠b\.c"),
    ],
)
def test_escaped_markdown_keeps_every_markup_character_literal(typed, shown):
    # "⁠" above is U+2060 WORD JOINER: it keeps GFM from turning a bare URL or address into a link
    assert escape_markdown(typed) == shown


def _outside(requests):
    return {
        u
        for u in requests
        if urlparse(u).scheme in ("http", "https", "ws", "wss")
        and urlparse(u).hostname not in ("127.0.0.1", "localhost")
    }


def _main_document_markup(page):
    """Images and links in the app's own DOM, and any rendered LaTeX (graph iframes are not included). Links are
    those leading to the typed host: the page's own heading anchors carry its URL, search text included."""
    return page.evaluate(
        """() => ({img: document.querySelectorAll('img').length,
                   a: [...document.querySelectorAll('a')].filter(a => a.hostname.includes('example.com')).map(a => a.href),
                   katex: document.querySelectorAll('.katex').length})"""
    )


@pytest.mark.browser
def test_markup_typed_in_the_search_box_is_shown_as_text(page, streamlit_url):
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(streamlit_url)
    graph_frame(page, captured("gpt2-tiny").summary.nodes)
    before = _main_document_markup(page)
    for typed in (IMAGE, LATEX):
        box = page.get_by_label("Search op, module or parameter")
        box.fill(typed)
        box.press("Enter")
        # the caption echoes the query literally: "no node matches “![x](http://example.com/t.png)”" (+ word joiner)
        page.wait_for_function(
            "t => [...document.querySelectorAll('[data-testid=stCaptionContainer]')]"
            ".some(c => c.innerText.replaceAll('\u2060', '').includes('no node matches “' + t + '”'))",
            arg=typed,
            timeout=30_000,
        )
    page.wait_for_timeout(500)
    assert _main_document_markup(page) == before
    assert not _outside(requests)


@pytest.mark.browser
def test_markup_typed_in_the_expression_box_is_shown_as_text(page, streamlit_url):
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(f"{streamlit_url}/toy_expressions")
    graph_frame(page, 6)
    before = _main_document_markup(page)
    for typed in (IMAGE, LATEX):
        box = page.get_by_label("Expression", exact=True).and_(page.locator("input"))
        box.fill(typed)
        box.press("Enter")
        page.locator('[data-testid="stAlert"]').first.wait_for(timeout=30_000)
        page.wait_for_timeout(500)
        assert _main_document_markup(page) == before, typed
    assert not _outside(requests)


@pytest.mark.browser
def test_four_downloads_clicked_in_quick_succession_all_arrive(page, streamlit_url):
    page.goto(streamlit_url)
    capture = captured("gpt2-tiny")
    graph_frame(page, capture.summary.nodes)
    names = ["HTML", "JSON", "GraphML", "DOT"]
    downloads = []
    page.on("download", lambda d: downloads.append(d))
    for name in names:  # the whole graph's row of download buttons
        page.locator(".st-key-downloads-whole").get_by_role("button", name=name, exact=True).click()
        page.wait_for_timeout(100)
    page.wait_for_timeout(3000)
    assert sorted(d.suggested_filename for d in downloads) == sorted(
        ["gpt2-tiny.html", "gpt2-tiny.json", "gpt2-tiny.graphml", "gpt2-tiny.dot"]
    )
    got = {d.suggested_filename: Path(d.path()).read_text() for d in downloads}
    assert json.loads(got["gpt2-tiny.json"])["summary"]["nodes"] == capture.summary.nodes  # 101
    assert got["gpt2-tiny.graphml"].count("<node ") == capture.summary.nodes


def test_sign_in_required_by_the_operator_shows_nothing_else(monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("GRAPHVIZ_CORE_REQUIRE_LOGIN", "1")
    # no [auth] provider configured: fail closed with a sentence for the operator
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    assert not at.exception and not at.metric and not at.get("iframe")  # nothing captured or drawn
    assert "no login provider is configured" in at.error[0].value
    # a provider configured (placeholders: the flow itself is the provider's), visitor not signed in yet
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)
    at.secrets["auth"] = {"redirect_uri": "http://localhost:8501/oauth2callback", "cookie_secret": "x" * 32}
    at.run()
    assert not at.exception and not at.metric and not at.get("iframe")
    assert [b.label for b in at.button] == ["Sign in"]
    monkeypatch.delenv("GRAPHVIZ_CORE_REQUIRE_LOGIN")  # off (the default): the page serves as before
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    assert at.metric[0].label == "Nodes" and not any(b.label == "Sign in" for b in at.button)
