"""Screenshots of the app for the README and docs: `python -m graphviz_core.ui.screenshot OUT.png [PAGE]`.

Starts the app, opens it in headless Chromium, waits until vis-network has drawn, and saves a PNG.
"""

from __future__ import annotations

import argparse
import sys

from graphviz_core.ui.live import CHROMIUM, CHROMIUM_ARGS, graph_frame, serve_app


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
        graph_frame(page, timeout_s=90)
        # Streamlit applies st.navigation and the page config when the script run ends; wait for that.
        page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)
        page.wait_for_timeout(2500)
        page.screenshot(path=args.output, full_page=True)
        browser.close()
    sys.stderr.write(f"wrote {args.output}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
