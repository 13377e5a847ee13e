"""vis-network's script served once as a static file the browser caches, instead of inlined into every graph frame.

Each graph frame is an `st.iframe` srcdoc sent over the websocket and parsed afresh on every re-draw; inlined, the
script was 470 KB of its ~560 KB. Served from the app's `static/` folder (Streamlit's `server.enableStaticServing`,
at `<baseUrlPath>/app/static/`), it comes from the same server (no external request) and the browser keeps it.
Where it cannot be served (static serving off, the folder not writable) the frame inlines it as before.
"""

from __future__ import annotations

from functools import lru_cache

import streamlit as st

from graphviz_core.export import vis_asset
from graphviz_core.export.vis_asset import STATIC, VIS_SCRIPT


def publish() -> str | None:
    """`vis_asset.publish` into this module's STATIC (a test points it elsewhere)."""
    return vis_asset.publish(STATIC)


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
