"""The app's pages opened by URL (/compare, /parallel) connect to the server at once, with no 404 on the way, and
start with the app's own page style.

Streamlit's frontend, loaded at a page's URL, looks for its server by probing `<path>/_stcore/health` and
`<path>/_stcore/host-config` from the deepest path up (`/compare/_stcore/health` first, then `/_stcore/health`): each
probe of a page's path answers 404, which the browser logs as a console error, and the connection waits for it. The
frontend skips the search when the page says where its server is (`window.__streamlit.BACKEND_BASE_URL`, the setting
Streamlit reads for an app embedded elsewhere). So each page's URL is answered with Streamlit's own index.html plus
one line of script that sets it: the page's own address less its page name, so a base path (`server.baseUrlPath`) or
a proxy's prefix is kept. The front page and every page also carry PAGE_CSS in their <head>, so the first paint has it
(app.py sets the same style from the script, which arrives ~0.4 s after the first title). Every other path is
Streamlit's as before.

`install()` adds these routes to the server Streamlit is about to start; call it before `streamlit run` (serve.py).
"""

from __future__ import annotations

import json
from pathlib import Path

PAGES = Path(__file__).resolve().parents[2] / "pages"
# Streamlit starts the main column 6rem (96 px) down: a blank band above every page's title that, on a laptop's 800 px,
# pushed the figures below the fold. The toolbar above it is transparent and holds only the running indicator, at the
# right; 1.5rem keeps the title clear of it (!important: over Streamlit's own rule, added later).
# Tables (st.table) fit their column at 1280 px: cells wrap at spaces, and the first two columns (a node id, a module
# path: long words) also inside a word; elsewhere "matmul" broke into "matmu l".
PAGE_CSS = ("[data-testid='stMainBlockContainer'] { padding-top: 1.5rem !important; }"
            " [data-testid='stTable'] :is(th, td, th *, td *) { white-space: normal !important; }"
            " [data-testid='stTable'] :is(td:nth-child(-n+2), td:nth-child(-n+2) *) { overflow-wrap: anywhere; }")
# Runs before Streamlit's module script (module scripts are deferred): its settings are read once, when it loads.
BASE_SCRIPT = """<script>
(function () {{
  var given = window.__streamlit || {{}}, page = {page};
  var url = new URL(window.location.href), path = url.pathname.replace(/\\/+$/, "");
  if (given.BACKEND_BASE_URL || path.slice(-page.length) !== page) {{ return; }}
  url.search = "";
  url.hash = "";
  url.pathname = path.slice(0, -page.length) || "/";
  window.__streamlit = Object.assign({{}}, given, {{BACKEND_BASE_URL: url.href}});
}})();
</script>"""


def page_paths(pages: Path = PAGES) -> tuple[str, ...]:
    """The URL path of every page of the app: st.Page names it after its file (pages/compare.py -> compare)."""
    return tuple(sorted(path.stem for path in pages.glob("*.py") if not path.stem.startswith("_")))


def index_html(page: str, index: str) -> str:
    """Streamlit's `index` with the app's style and, for a page at `…/<page>` (not the front page, ""), the script that
    names the server."""
    script = BASE_SCRIPT.format(page=json.dumps("/" + page)) if page else ""
    head = index.index("<head>") + len("<head>")
    return index[:head] + f"<style>{PAGE_CSS}</style>" + script + index[head:]


def page_routes(base_url: str = "") -> list:
    """A route per page, and the front page, answering GET with index.html, the style and the script (no-cache, as
    Streamlit serves it)."""
    from starlette.responses import HTMLResponse
    from starlette.routing import Route
    from streamlit import file_util
    from streamlit.url_util import make_url_path

    index = (Path(file_util.get_static_dir()) / "index.html").read_text(encoding="utf-8")
    routes = []
    for page in ("", *page_paths()):
        body = index_html(page, index)

        async def answer(request, body: str = body) -> HTMLResponse:
            return HTMLResponse(body, headers={"Cache-Control": "no-cache"})

        path = make_url_path(base_url, page)
        for url in {path, path.rstrip("/") or "/"}:
            routes.append(Route(url, answer, methods=["GET"], name=f"page-{page or 'front'}"))
    return routes


def install() -> None:
    """Put the page routes ahead of Streamlit's own in the server `streamlit run` starts (once per process)."""
    from streamlit import config
    from streamlit.web.server.starlette import starlette_app

    streamlit_routes = starlette_app.create_streamlit_routes
    if getattr(streamlit_routes, "with_page_routes", False):
        return

    def with_page_routes(runtime):
        return [*page_routes(config.get_option("server.baseUrlPath") or ""), *streamlit_routes(runtime)]

    with_page_routes.with_page_routes = True
    starlette_app.create_streamlit_routes = with_page_routes
