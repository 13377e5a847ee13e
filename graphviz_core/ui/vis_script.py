"""vis-network's script served once as a static file the browser caches, instead of inlined into every graph frame.

Each graph frame is an `st.iframe` srcdoc sent over the websocket and parsed afresh on every re-draw; inlined, the
script was 470 KB of its ~560 KB. Served from the app's `static/` folder (Streamlit's `server.enableStaticServing`,
at `<baseUrlPath>/app/static/`), it comes from the same server (no external request) and the browser keeps it.
Where it cannot be served (static serving off, the folder not writable) the frame inlines it as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from functools import lru_cache
from pathlib import Path

import streamlit as st

from graphviz_core.export.render import VIS_SCRIPT

STATIC = Path(__file__).resolve().parents[2] / "static"  # beside app.py: Streamlit serves it at /app/static/
_log = logging.getLogger(__name__)


def publish() -> str | None:
    """Copy pyvis's vis-network.min.js into static/ unless it is there already, unchanged (`make run`, `make serve`
    and `make test` do this at set-up, so the server they start finds it and writes nothing); its content's digest,
    or None when it cannot be published."""
    target = STATIC / VIS_SCRIPT.name
    script = VIS_SCRIPT.read_bytes()
    try:
        if not (target.exists() and target.read_bytes() == script):
            STATIC.mkdir(exist_ok=True)
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            # copy2 keeps pyvis's modification time: the browser's cache then treats the file as long unchanged
            shutil.copy2(VIS_SCRIPT, partial)
            partial.replace(target)
    except OSError as error:
        _log.warning("vis-network is inlined into every graph frame: cannot publish it in %s (%s)", STATIC, error)
        return None
    return hashlib.sha256(script).hexdigest()[:12]


@lru_cache(maxsize=1)
def _published() -> str | None:
    """`publish()`, once per process: a server started otherwise than by make copies it at its first graph."""
    return publish()


def vis_src() -> str | None:
    """The URL graph frames load vis-network from, or None to inline it (static serving off or not possible).

    The URL names the script's content (`?v=`): after pyvis is upgraded, a browser that kept the old file under
    the same name asks for the new one instead of running the old."""
    digest = _published() if st.get_option("server.enableStaticServing") else None
    if digest is None:
        return None
    base = st.get_option("server.baseUrlPath").strip("/")
    return f"{'/' + base if base else ''}/app/static/{VIS_SCRIPT.name}?v={digest}"
