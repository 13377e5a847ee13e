"""Graph view speed: server-side layout + HTML render, and first draw in headless Chromium.

Graphs: gpt2 stacks on meta (shapes only, so capture is instant) sized to ~2,700 and ~10,000 nodes.
First draw = vis-network's first `afterDrawing` event, measured by the page itself (performance.now()
from navigation start), loading the standalone HTML from disk. Goals on this machine: layout <= 0.5 s at
2,700 nodes; first draw <= 1.5 s at ~2,700 and <= 3 s at ~10,000.

    python benchmarks/bench_render.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright
from readme_rows import row

from graphviz_core.capture.engine import capture_backward
from graphviz_core.config import ModelConfig
from graphviz_core.export.render import render_html
from graphviz_core.graph.layout import layered_layout
from graphviz_core.ui.browser_harness import CHROMIUM, CHROMIUM_ARGS

SIZES = {"~2,700 nodes": dict(layers=48, attention="manual"), "~10,000 nodes": dict(layers=160, attention="manual")}
GOALS = {"~2,700 nodes": 1.5, "~10,000 nodes": 3.0}


def main() -> None:
    with sync_playwright() as p, tempfile.TemporaryDirectory() as tmp:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for name, shape in SIZES.items():
            capture = capture_backward(ModelConfig(model="gpt2", device="meta", **shape))
            graph = capture.graph
            layouts = []
            for _ in range(3):
                started = time.perf_counter()
                layered_layout(graph)
                layouts.append(time.perf_counter() - started)
            started = time.perf_counter()
            html = render_html(graph, title=name)
            render_s = time.perf_counter() - started
            path = Path(tmp) / "graph.html"
            path.write_text(html)
            draws = []
            for _ in range(3):
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.goto(path.as_uri())
                page.wait_for_function("window.__firstDrawMs !== undefined", timeout=120_000)
                assert page.evaluate("window.network.body.data.nodes.length") == graph.number_of_nodes()
                draws.append(page.evaluate("window.__firstDrawMs") / 1000)
                page.close()
            draw = statistics.median(draws)
            print(f"{name}: {graph.number_of_nodes():,} nodes, {graph.number_of_edges():,} edges, HTML {len(html) / 2**20:.1f} MiB")
            print(f"  layout median {statistics.median(layouts):.3f} s; layout+render {render_s:.3f} s")
            print(f"  first draw in Chromium: median {draw:.3f} s {[round(d, 3) for d in draws]} "
                  f"-> {draw / GOALS[name]:.2f} of the {GOALS[name]} s goal")
            row(f"layout, {graph.number_of_nodes():,} nodes", f"{statistics.median(layouts):.3f} s", "<= 0.5 s")
            row(f"first draw in headless Chromium, {graph.number_of_nodes():,} nodes", f"{draw:.2f} s", f"<= {GOALS[name]:g} s")
        browser.close()


if __name__ == "__main__":
    main()
