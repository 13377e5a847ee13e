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
