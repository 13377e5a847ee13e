"""Shared fixtures: captures are expensive enough to share within a test session."""

from __future__ import annotations

import functools

import pytest

from graphviz_core.capture import Capture, capture_backward
from graphviz_core.config import config_from_preset


@functools.lru_cache(maxsize=64)
def captured(preset: str, **overrides) -> Capture:
    """One capture per (preset, overrides) for the whole test session."""
    return capture_backward(config_from_preset(preset, **overrides))


@pytest.fixture(autouse=True)
def _cpu_unless_asked(monkeypatch):
    # 'auto' means CPU in tests unless a test says otherwise (a GPU box runs the same numbers).
    monkeypatch.setenv("GRAPHVIZ_CORE_DEVICE", "cpu")


# ---- browser tests: a live Streamlit server and headless Chromium ------------------------------------

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def streamlit_url():
    """`streamlit run app.py` on a free localhost port, for the whole session."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    port = _free_port()
    env = {**os.environ, "GRAPHVIZ_CORE_DEVICE": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), "--server.port", str(port),
         "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
         "--server.fileWatcherType", "none"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.read() == b"ok":
                    break
        except OSError:
            time.sleep(0.3)
    else:
        proc.kill()
        raise RuntimeError("streamlit did not start: " + proc.stderr.read().decode()[-2000:])
    yield url
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="session")
def browser():
    import os

    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1500, "height": 1000})
    pg = context.new_page()
    yield pg
    context.close()
