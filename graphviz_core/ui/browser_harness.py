"""The test-server harness for tooling and browser tests: `streamlit run app.py` on a free localhost port, and the
Chromium flags this environment needs (Debian's /usr/bin/chromium driven by Playwright)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from graphviz_core.export.formats import CHROMIUM, CHROMIUM_ARGS  # noqa: F401 - one definition, shared with PNG export

ROOT = Path(__file__).resolve().parents[2]

# True in the page once Streamlit has no script run in progress: the app root's script state (the attribute Streamlit's
# own browser tests read) is "notRunning". Its "Running..." widget is no sign: with the toolbar in "minimal" mode
# (.streamlit/config.toml) Streamlit never draws it, so a wait for it to be gone returned at once, mid-run.
NO_RUN = "() => document.querySelector('[data-testid=\"stApp\"]')?.dataset.testScriptState === 'notRunning'"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120, poll_s: float = 0.02,
                 log: Path | None = None) -> None:
    """Return once `url` answers Streamlit's health check; RuntimeError (with the end of the server's stderr when it
    goes to the file `log`) if the server exits or `timeout_s` passes."""
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.read() == b"ok":
                    return
        except OSError:
            if proc.poll() is not None or time.perf_counter() > deadline:
                tail = log.read_text(errors="replace")[-2000:] if log is not None else ""
                raise RuntimeError("streamlit did not start: " + tail) from None
            time.sleep(poll_s)


@contextlib.contextmanager
def serve_app(env: dict | None = None, timeout_s: float = 90, log: Path | None = None) -> Iterator[str]:
    """Start the app on 127.0.0.1:<free port>, wait until healthy, yield its URL, stop it afterwards.

    Its stderr goes to the file `log` (by default one in a temporary folder, removed afterwards), to be read when
    something failed; never to a pipe, which nobody reads while the server runs (past 64 KiB the server's next write
    to stderr would block)."""
    port = free_port()
    with contextlib.ExitStack() as stack:
        if log is None:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="graphviz-core-app-"))) / "server.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                # as `make run` starts it (graphviz_core.ui.serve: `streamlit run app.py` plus imports in the background)
                [sys.executable, "-m", "graphviz_core.ui.serve", "--server.port", str(port),
                 "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
                 "--server.fileWatcherType", "none"],
                cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=err,
            )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, timeout_s, log=log)
            yield url
        finally:
            stop_server(proc)


def stop_server(proc: subprocess.Popen, within_s: float = 20) -> None:
    """SIGTERM, and SIGKILL if the server has not exited `within_s` later."""
    proc.terminate()
    try:
        proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def graph_frame(page, expected_nodes: int | None = None, timeout_s: float = 60):
    """The frame whose vis-network page has drawn (`expected_nodes` nodes, when given).

    Streamlit embeds the graph in an iframe and replaces it whenever the view changes, so frames are
    searched afresh until one matches or `timeout_s` passes.
    """
    deadline = time.time() + timeout_s
    seen = None
    while time.time() < deadline:
        for frame in page.frames:
            try:
                if not frame.evaluate("() => window.__firstDrawMs !== undefined && window.network !== undefined"):
                    continue
                seen = frame.evaluate("window.network.body.data.nodes.length")
            except Exception:  # noqa: BLE001 - a frame torn down while Streamlit re-renders
                continue
            if expected_nodes is None or seen == expected_nodes:
                return frame
        page.wait_for_timeout(250)
    wanted = "a graph" if expected_nodes is None else f"{expected_nodes} nodes"
    raise TimeoutError(f"no frame drew {wanted} within {timeout_s:g} s (last seen: {seen})")
