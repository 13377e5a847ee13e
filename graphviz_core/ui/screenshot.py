"""Screenshots of the app for the README and docs: `python -m graphviz_core.ui.screenshot OUT.png [PAGE]`.

Starts the app, opens it in headless Chromium, waits until vis-network has drawn, and saves a PNG.
"""

from __future__ import annotations

import argparse
import sys

from graphviz_core.ui.live import CHROMIUM, CHROMIUM_ARGS, serve_app


def wait_for_graph(page, timeout_s: float = 90) -> None:
    """Until some frame's vis-network has drawn (Streamlit embeds the graph in an iframe)."""
    deadline_ms = timeout_s * 1000
    waited = 0
    while waited < deadline_ms:
        for frame in page.frames:
            try:
                if frame.evaluate("() => window.__firstDrawMs !== undefined"):
                    return
            except Exception:  # noqa: BLE001 - frames come and go while Streamlit re-renders
                continue
        page.wait_for_timeout(250)
        waited += 250
    raise TimeoutError("the graph did not draw")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output")
    parser.add_argument("--path", default="", help="page path, e.g. toy_expressions")
    parser.add_argument("--width", type=int, default=1500)
    parser.add_argument("--height", type=int, default=1300)
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    with serve_app({"GRAPHVIZ_CORE_DEVICE": "cpu"}) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": args.width, "height": args.height})
        page.goto(f"{url}/{args.path}")
        wait_for_graph(page)
        # Streamlit applies st.navigation and the page config when the script run ends; wait for that.
        page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)
        page.wait_for_timeout(2500)
        page.screenshot(path=args.output, full_page=True)
        browser.close()
    sys.stderr.write(f"wrote {args.output}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
