"""Graph view frame rate: zoom and pan on the whole-graph view in headless Chromium (issue 13, goal 2).

Graphs are real captures on `meta` (shapes only, so they are instant): gpt2-tiny (101 nodes) and gpt2 stacks
with unfused attention, 48 layers (2,991 nodes) and 160 layers (9,935 nodes). Each is rendered to the
standalone page twice, without and with level of detail (render_html's `level_of_detail`), so the before and
after figures come from one run on one machine. Every scenario starts from "Fit all" (the whole graph):

- zoom: `network.moveTo` from the fitted scale to 4x it, animated over 2 s (what the issue specifies);
- wheel: a mouse-wheel event on the canvas every frame for 2 s, zoomSpeed 0.2 (2 % a notch), the way a
  user zooms; vis-network's `hideEdgesOnZoom` only applies to this path;
- pan: `network.moveTo` sideways by half the pane at the fitted scale, over 2 s.

Frames are counted with requestAnimationFrame: fps = frames / seconds, and the 95th percentile frame gap.
Both pages stay open and take turns (order swapped each round), so load spikes hit both; the figures are
the median fps over rounds and the 95th percentile of all frame gaps pooled.
Goals: >= 30 fps at ~3,000 nodes and >= 20 fps at ~10,000. Chromium runs with --disable-gpu here, so this is
software rasterisation on a shared 2-core machine: figures move with the load (printed with them).

    python benchmarks/bench_fps.py [--sizes 100,3000,10000] [--seconds 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright
from readme_rows import row

from graphviz_core.capture.engine import capture_backward
from graphviz_core.config import ModelConfig, config_from_preset
from graphviz_core.export.render import render_html
from graphviz_core.ui.browser_harness import CHROMIUM, CHROMIUM_ARGS

SIZES = {
    100: lambda: config_from_preset("gpt2-tiny", device="meta"),
    3000: lambda: ModelConfig(model="gpt2", layers=48, attention="manual", device="meta"),
    10000: lambda: ModelConfig(model="gpt2", layers=160, attention="manual", device="meta"),
}
GOAL_FPS = {100: None, 3000: 30, 10000: 20}
VIEWPORT = {"width": 1400, "height": 900}
KINDS = ("zoom", "wheel", "pan")

# Runs inside the page: start at "Fit all", animate, and return the requestAnimationFrame timestamps.
MEASURE = """async ([kind, ms]) => {
  const net = window.network;
  const pause = (t) => new Promise((r) => setTimeout(r, t));
  net.fit({animation: false});
  await pause(400);
  const scale = net.getScale(), centre = net.getViewPosition();
  const canvas = document.querySelector('#graph canvas');
  const box = canvas.getBoundingClientRect();
  if (kind === 'wheel') net.setOptions({interaction: {zoomSpeed: 0.2}});
  const stamps = [];
  let running = true;
  const start = await new Promise((r) => requestAnimationFrame(r));
  function tick(t) {
    stamps.push(t);
    if (kind === 'wheel') {
      canvas.dispatchEvent(new WheelEvent('wheel', {deltaY: -1, clientX: box.left + box.width / 2,
                                                     clientY: box.top + box.height / 2, bubbles: true, cancelable: true}));
    }
    if (running) requestAnimationFrame(tick);
  }
  requestAnimationFrame(tick);
  if (kind === 'zoom') {
    net.moveTo({scale: scale * 4, animation: {duration: ms, easingFunction: 'linear'}});
  } else if (kind === 'pan') {
    net.moveTo({position: {x: centre.x + box.width / 2 / scale, y: centre.y}, scale: scale,
                animation: {duration: ms, easingFunction: 'linear'}});
  }
  await pause(ms);
  running = false;
  await pause(300);
  return {stamps: stamps.filter((t) => t >= start && t <= start + ms + 250), from: scale, to: net.getScale()};
}"""


def frame_stats(runs: list[list[float]]) -> tuple[float, float]:
    """(frames per second, 95th percentile gap in ms) from runs of requestAnimationFrame timestamps."""
    gaps = [b - a for stamps in runs for a, b in zip(stamps, stamps[1:], strict=False)]
    if not gaps:
        return 0.0, float("inf")
    fps = len(gaps) / (sum(gaps) / 1000)
    p95 = statistics.quantiles(gaps, n=20)[-1] if len(gaps) >= 2 else gaps[0]
    return fps, p95


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,3000,10000")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ms = int(args.seconds * 1000)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; Chromium {' '.join(CHROMIUM_ARGS)}")
    with sync_playwright() as p, tempfile.TemporaryDirectory() as tmp:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for size in (int(s) for s in args.sizes.split(",")):
            graph = capture_backward(SIZES[size]()).graph
            goal = GOAL_FPS[size]
            print(f"\n~{size:,} nodes: {graph.number_of_nodes():,} nodes, {graph.number_of_edges():,} edges"
                  f"  (goal: {f'>= {goal} fps' if goal else 'none stated'})")
            pages = {}
            for lod in (False, True):
                path = Path(tmp) / f"graph-{size}-{lod}.html"
                path.write_text(render_html(graph, title=f"~{size} nodes", level_of_detail=lod))
                pages[lod] = browser.new_page(viewport=VIEWPORT)
                pages[lod].goto(path.as_uri())
                pages[lod].wait_for_function("window.__firstDrawMs !== undefined", timeout=120_000)
            results = {(lod, kind): [] for lod in pages for kind in KINDS}
            for round_ in range(args.rounds):
                for kind in KINDS:
                    for lod in ((False, True) if round_ % 2 == 0 else (True, False)):
                        pages[lod].bring_to_front()
                        results[lod, kind].append(pages[lod].evaluate(MEASURE, [kind, ms]))
            for page in pages.values():
                page.close()
            for kind in KINDS:
                for lod in (False, True):
                    runs = results[lod, kind]
                    fps = statistics.median(frame_stats([r["stamps"]])[0] for r in runs)
                    p95 = frame_stats([r["stamps"] for r in runs])[1]
                    verdict = "" if not goal else ("  meets goal" if fps >= goal else f"  {fps / goal:.2f} of goal")
                    print(f"  {kind:<5} {'with' if lod else 'without':>7} level of detail: {fps:5.1f} fps, "
                          f"p95 frame gap {p95:6.1f} ms  (scale {runs[0]['from']:.3f} -> {runs[0]['to']:.3f}){verdict}")
                    if lod and goal:
                        row(f"{kind} on the whole graph, {graph.number_of_nodes():,} nodes, headless Chromium "
                            "without GPU", f"{fps:.1f} fps (p95 frame gap {p95:.0f} ms)", f">= {goal} fps")
        browser.close()


if __name__ == "__main__":
    main()
