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


@pytest.fixture(scope="session")
def streamlit_url():
    """`streamlit run app.py` on a free localhost port, for the whole session."""
    from graphviz_core.ui.live import serve_app

    with serve_app({"GRAPHVIZ_CORE_DEVICE": "cpu"}) as url:
        yield url


@pytest.fixture(scope="session")
def browser():
    import os

    from graphviz_core.ui.live import CHROMIUM, CHROMIUM_ARGS

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
