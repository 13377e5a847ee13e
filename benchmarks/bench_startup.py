"""Start-up speed: cold server to first graph drawn in headless Chromium, a warm revisit, and the CLI's wall time.

- cold start: wall time from launching `streamlit run app.py` (a fresh process, so every import and every
  one-time initialisation is paid) until the default graph has drawn in a new browser tab that was
  pointed at the server as soon as it answered. Chromium is started before the clock starts.
- warm revisit: a new tab (a new Streamlit session) on the same server, from `goto` to the graph drawn, in a new
  browser context (nothing cached: Streamlit's ~5 MB of script fetched and compiled again, as for a newcomer);
- new tab, same browser: the same, in the cold tab's browser context (its HTTP cache: a person opening a second tab).
- CLI: wall time of `python -m graphviz_core graph --preset gpt2-tiny --format json` in a fresh process.
- first capture's forward time vs a second capture's in the same process (issue 12 item 8: one-time
  warm-up must not be charged to the user's measurement).

"Drawn" means vis-network's first `afterDrawing` event fired in the graph's frame (`window.__firstDrawMs`),
checked every 50 ms. Medians and minimums over --rounds fresh servers; goals from issue 13.

    python benchmarks/bench_startup.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright
from readme_rows import row
from servers import SERVE, STREAMLIT

from graphviz_core.ui.browser_harness import CHROMIUM, CHROMIUM_ARGS, free_port, stop_server, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
GOALS_S = {"cold start -> first graph": 3.0, "warm revisit -> graph": 1.0, "new tab, same browser -> graph": 1.0,
           "CLI graph --format json": 3.0}
FIRST_FORWARD = (
    "import time\n"
    "from graphviz_core.capture.engine import capture_backward\n"
    "from graphviz_core.config import config_from_preset\n"
    "c = [capture_backward(config_from_preset('gpt2-tiny', device='cpu')) for _ in range(2)]\n"
    "print(c[0].time.forward_s, c[1].time.forward_s)\n"
)


def _env() -> dict:
    return {**os.environ, "GRAPHVIZ_CORE_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}


def _wait_drawn(page, started: float, timeout_s: float = 120) -> float:
    """Seconds from `started` until some frame of `page` has drawn its graph."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        for frame in page.frames:
            try:
                if frame.evaluate("() => window.__firstDrawMs !== undefined && window.network !== undefined"):
                    return time.perf_counter() - started
            except Exception:  # noqa: BLE001 - a frame torn down while Streamlit re-renders
                continue
        page.wait_for_timeout(50)
    raise TimeoutError("no graph drawn")


LAUNCHERS = {"make run (graphviz_core.ui.serve)": SERVE, "streamlit run app.py": STREAMLIT}  # rounds interleaved


def server_round(browser, launcher: list[str]) -> tuple[float, float, float, float]:
    """(seconds to HTTP health, cold start to first graph, warm revisit, new tab in the same browser) for one fresh
    server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    proc = subprocess.Popen(
        [
            *launcher,
            "--server.port",
            str(port),
            "--server.address",
            "127.0.0.1",
            "--server.headless",
            "true",
            "--browser.gatherUsageStats",
            "false",
            "--server.fileWatcherType",
            "none",
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(url, proc)
        healthy = time.perf_counter() - started
        first = browser.new_context(viewport={"width": 1280, "height": 800})
        page = first.new_page()
        page.goto(url)
        cold = _wait_drawn(page, started)
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        page = context.new_page()
        revisit_started = time.perf_counter()
        page.goto(url)
        warm = _wait_drawn(page, revisit_started)
        context.close()
        page = first.new_page()
        tab_started = time.perf_counter()
        page.goto(url)
        tab = _wait_drawn(page, tab_started)
        first.close()
        return healthy, cold, warm, tab
    finally:
        stop_server(proc)


def cli_round() -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "graphviz_core", "graph", "--preset", "gpt2-tiny", "--format", "json", "-o", os.devnull],
        cwd=ROOT,
        env=_env(),
        check=True,
    )
    return time.perf_counter() - started


def _report(name: str, values: list[float], how: str = "") -> None:
    median = statistics.median(values)
    goal = GOALS_S.get(name)
    verdict = f"(goal <= {goal:g} s: {'met' if median <= goal else 'NOT met'})" if goal else ""
    print(f"{name}: median {median:.2f} s, min {min(values):.2f} s {[round(v, 2) for v in values]} {verdict}")
    if goal:
        row(f"{name}{f' ({how})' if how else ''}", f"{median:.2f} s (median of {len(values)}, min {min(values):.2f} s)", f"<= {goal:g} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    healthy, cold, warm, tab = ({name: [] for name in LAUNCHERS} for _ in range(4))
    cli, first, second = [], [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for i in range(args.rounds):
            names = list(LAUNCHERS) if i % 2 == 0 else list(reversed(LAUNCHERS))  # order alternates
            for name in names:
                h, c, w, t = server_round(browser, LAUNCHERS[name])
                healthy[name].append(h)
                cold[name].append(c)
                warm[name].append(w)
                tab[name].append(t)
        browser.close()
    for _ in range(args.rounds):
        cli.append(cli_round())
        done = subprocess.run(
            [sys.executable, "-c", FIRST_FORWARD], cwd=ROOT, env=_env(), check=True, capture_output=True, text=True
        )
        a, b = (float(x) for x in done.stdout.split())
        first.append(a)
        second.append(b)
    print(f"{args.rounds} rounds, each with a fresh server / process; load average {os.getloadavg()[0]:.2f}")
    for name in LAUNCHERS:
        print(f"-- {name}")
        _report("server answers HTTP", healthy[name], name)
        _report("cold start -> first graph", cold[name], name)
        _report("warm revisit -> graph", warm[name], f"{name}, new browser context")
        _report("new tab, same browser -> graph", tab[name], name)
    plain, served = (statistics.median(cold[name]) for name in reversed(LAUNCHERS))
    print(f"cold start, make run / streamlit run: {served / plain:.2f}x")
    _report("CLI graph --format json", cli)
    ratios = [a / b for a, b in zip(first, second, strict=True)]
    print(
        f"gpt2-tiny forward, first capture in a process: median {statistics.median(first) * 1000:.1f} ms; "
        f"second: {statistics.median(second) * 1000:.1f} ms; paired ratio median {statistics.median(ratios):.2f}x "
        f"(one-time warm-up kept out of the timed forward)"
    )
    row("gpt2-tiny: first capture's forward time / a second's, fresh process",
        f"{statistics.median(ratios):.2f}x ({statistics.median(first) * 1000:.1f} vs {statistics.median(second) * 1000:.1f} ms)",
        "about 1x")


if __name__ == "__main__":
    main()
