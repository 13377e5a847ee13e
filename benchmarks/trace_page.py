"""Where a page load's time goes: one fresh server, a cold tab and a warm revisit, each as a timeline.

For each tab, times in seconds from `goto`: the HTML, Streamlit's JS bundle (first and last script response),
the websocket opened, the first and last websocket frame of the script run (and the biggest frame: the graph's
HTML), the graph's iframe created, its scripts parsed (`performance.mark`s the template sets) and vis-network's
first draw. Clocks are aligned through wall time (CDP's `wallTime`, the frames' `performance.timeOrigin`).

    PYTHONPATH=. python benchmarks/trace_page.py [--rounds N] [--launcher serve|streamlit]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

from playwright.sync_api import sync_playwright
from servers import SERVE, STREAMLIT

from graphviz_core.ui.browser_harness import CHROMIUM, CHROMIUM_ARGS, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = {"serve": SERVE, "streamlit": STREAMLIT}
MARKS = ("graph-html", "vis-parsed", "network-created")


def start(launcher: str, env: dict | None = None, options: list[str] = ()) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.time()
    proc = subprocess.Popen(
        [*LAUNCHERS[launcher], "--server.port", str(port), "--server.address", "127.0.0.1",
         "--server.headless", "true", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
         *options],
        cwd=ROOT, env={**os.environ, "GRAPHVIZ_CORE_DEVICE": "cpu", "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_healthy(url, proc)
    return proc, url, started


def tab(browser, url: str, context=None) -> dict[str, float]:
    """A new tab opening `url` (in `context`, sharing its cache, else in a new browser context): named moments
    in wall-clock seconds (time.time())."""
    own = context is None
    context = context or browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    cdp = context.new_cdp_session(page)
    cdp.send("Network.enable")
    offset = {}  # CDP monotonic timestamp -> wall time, from the first requestWillBeSent
    requests: dict[str, dict] = {}
    frames: list[tuple[float, int]] = []
    moments: dict[str, float] = {}

    def wall(ts: float) -> float:
        return ts + offset["d"]

    def will_send(e):
        offset.setdefault("d", e["wallTime"] - e["timestamp"])
        requests[e["requestId"]] = {"url": e["request"]["url"], "type": e.get("type"), "sent": wall(e["timestamp"])}

    def finished(e):
        if e["requestId"] in requests:
            requests[e["requestId"]].update(done=wall(e["timestamp"]), bytes=e.get("encodedDataLength", 0))

    cdp.on("Network.requestWillBeSent", will_send)
    cdp.on("Network.loadingFinished", finished)
    cdp.on("Network.webSocketCreated", lambda e: moments.setdefault("websocket created", time.time()))
    cdp.on("Network.webSocketFrameReceived",
           lambda e: frames.append((wall(e["timestamp"]), len(e["response"]["payloadData"]))) if "d" in offset else None)
    moments["goto"] = time.time()
    page.goto(url)
    drawn = None
    deadline = time.time() + 120
    while drawn is None and time.time() < deadline:
        for frame in page.frames:
            try:
                drawn = frame.evaluate(
                    "() => window.__firstDrawMs === undefined ? null : {origin: performance.timeOrigin, first: window.__firstDrawMs,"
                    " html: document.documentElement.outerHTML.length, marks: Object.fromEntries("
                    "performance.getEntriesByType('mark').map(m => [m.name, m.startTime]))}")
            except Exception:  # noqa: BLE001 - a frame torn down while Streamlit re-renders
                continue
            if drawn:
                break
        page.wait_for_timeout(20)
    if drawn is None:
        raise TimeoutError("no graph drawn")
    nav = page.evaluate("() => ({origin: performance.timeOrigin, dcl: performance.timing.domContentLoadedEventEnd,"
                        " load: performance.timing.loadEventEnd})")
    moments["main DOMContentLoaded"] = nav["dcl"] / 1000
    moments["main load"] = nav["load"] / 1000
    docs = [r for r in requests.values() if r["type"] == "Document"]
    scripts = [r for r in requests.values() if r["type"] == "Script" and "done" in r]
    if docs and "done" in docs[0]:
        moments["HTML received"] = docs[0]["done"]
    if scripts:
        moments["first script received"] = min(r["done"] for r in scripts)
        moments["last script received"] = max(r["done"] for r in scripts)
        moments["script bytes (KB)"] = sum(r["bytes"] for r in scripts) / 1000
    if frames:
        moments["first ws frame"] = frames[0][0]
        big = max(frames, key=lambda f: f[1])
        moments["biggest ws frame"] = big[0]
        moments["biggest ws frame (KB)"] = big[1] / 1000
        moments["ws frames"] = len(frames)
    if os.environ.get("TRACE_SCRIPTS"):
        for r in sorted(scripts, key=lambda r: r["done"]):
            print(f"    {r['sent'] - moments['goto']:.3f} -> {r['done'] - moments['goto']:.3f} {r['bytes'] / 1000:7.1f} KB {r['url'][-60:]}")
    moments["iframe origin"] = drawn["origin"] / 1000
    for mark in MARKS:
        if mark in drawn["marks"]:
            moments[f"iframe {mark}"] = (drawn["origin"] + drawn["marks"][mark]) / 1000
    moments["iframe first draw"] = (drawn["origin"] + drawn["first"]) / 1000
    moments["iframe HTML (KB)"] = drawn["html"] / 1000
    if own:
        context.close()
    else:
        page.close()
    return moments


def relative(moments: dict[str, float], zero: float) -> dict[str, float]:
    return {k: (v if "(" in k or k == "ws frames" else v - zero) for k, v in moments.items()}


def parse_variant(text: str) -> tuple[str, dict, list[str]]:
    """NAME:VAR=VALUE,...:--streamlit.option value ... (env and options may be empty)"""
    name, env, options = (text.split(":", 2) + ["", ""])[:3]
    return name, dict(kv.split("=", 1) for kv in env.split(",") if kv), options.split()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--launcher", choices=list(LAUNCHERS), default="serve")
    parser.add_argument("--warm", type=int, default=2, help="warm revisits per server")
    parser.add_argument("--same-browser", action="store_true",
                        help="warm revisits open a new tab in the cold tab's browser context (its cache), not a new context")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:ENV=V,...:--option value ...; several are interleaved round by round")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant] or [("as is", {}, [])]
    cold = {v[0]: [] for v in variants}
    warm = {v[0]: [] for v in variants}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for i in range(args.rounds):
            for name, env, options in variants if i % 2 == 0 else list(reversed(variants)):
                proc, url, started = start(args.launcher, env, options)
                try:
                    healthy = time.time()
                    shared = browser.new_context(viewport={"width": 1280, "height": 800}) if args.same_browser else None
                    m = tab(browser, url, shared)
                    cold[name].append({"server start -> healthy": healthy - started, **relative(m, started)})
                    for _ in range(args.warm):
                        m = tab(browser, url, shared)
                        warm[name].append(relative(m, m["goto"]))
                    if shared is not None:
                        shared.close()
                finally:
                    proc.terminate()
                    proc.wait(timeout=20)
        browser.close()
    print(f"load average {os.getloadavg()}")
    for name, *_ in variants:
        for kind, runs in (("cold (from server launch)", cold[name]), ("warm revisit (from goto)", warm[name])):
            print(f"-- {name}: {kind}: median of {len(runs)}")
            keys = sorted({k for r in runs for k in r}, key=lambda k: statistics.median(r.get(k, 0) for r in runs))
            for k in keys:
                values = [r[k] for r in runs if k in r]
                print(f"  {k:32s} {statistics.median(values):8.3f}   {[round(v, 3) for v in values]}")


if __name__ == "__main__":
    main()
