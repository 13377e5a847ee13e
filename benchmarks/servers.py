"""Starting the app for a benchmark: the two launchers measured side by side, and waiting for the server's health."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `make run` starts the app through graphviz_core.ui.serve (imports and warm-up in the background while the server
# starts); plain `streamlit run app.py` is measured beside it.
SERVE = [sys.executable, "-m", "graphviz_core.ui.serve"]
STREAMLIT = [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py")]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Return once `url` answers Streamlit's health check; RuntimeError if the server exits or `timeout_s` passes."""
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.read() == b"ok":
                    return
        except OSError:
            if proc.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError("streamlit did not start") from None
            time.sleep(0.02)
