"""Start the web app the way `make run` and `make serve` do: `python -m graphviz_core.ui.serve [streamlit options]`.

The same as `streamlit run app.py [options]`, plus one thing: while Streamlit's server starts and the first
browser loads its frontend, a background thread imports what the pages need (torch, pandas, altair, the
panels; several seconds on a small machine) and pays the process's one-time capture costs
(graphviz_core.capture.warm_up). The first page then finds them done instead of starting them when the
first visitor arrives. Nothing else differs: same app, same options, same process.
"""

from __future__ import annotations

import importlib
import sys
import threading
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app.py"
# What the pages import, heaviest first (torch comes with the first)
PRELOAD = (
    "graphviz_core.capture",
    "graphviz_core.ui.capture_cache",
    "graphviz_core.ui.config_form",
    "graphviz_core.ui.graph_view",
    "graphviz_core.ui.summary",
    "graphviz_core.ui.flops_view",
    "graphviz_core.ui.memory_view",
    "graphviz_core.ui.textbook_view",
)


def preload() -> None:
    """Import the pages' modules, then warm the capture path on the device `auto` picks (errors are left for
    the page to meet and report: this only saves time)."""
    try:
        from graphviz_core.capture import warm_up
        from graphviz_core.device import resolve_device

        # The imports run under the warm-up's lock: a first capture that starts meanwhile waits for them rather
        # than have its timed forward share the CPU with them (gpt2-tiny's first forward read 353 ms, not ~5).
        warm_up(resolve_device("auto"), before=lambda: [importlib.import_module(name) for name in PRELOAD])
    except Exception:  # noqa: BLE001 - the page imports the same modules and shows any error itself
        pass


def main(argv: list[str] | None = None) -> None:
    threading.Thread(target=preload, name="preload", daemon=True).start()
    from streamlit.web import cli

    cli.main(["run", str(APP), *(sys.argv[1:] if argv is None else argv)], prog_name="streamlit")


if __name__ == "__main__":
    main()
