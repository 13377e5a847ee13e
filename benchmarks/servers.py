"""Starting the app for a benchmark: the two launchers measured side by side (graphviz_core.ui.browser_harness.wait_healthy
waits for the server)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `make run` starts the app through graphviz_core.ui.serve (imports and warm-up in the background while the server
# starts); plain `streamlit run app.py` is measured beside it.
SERVE = [sys.executable, "-m", "graphviz_core.ui.serve"]
STREAMLIT = [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py")]
