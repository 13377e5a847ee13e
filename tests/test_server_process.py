"""The served app as an operator runs it (`python -m graphviz_core.ui.serve`, what `make serve` starts), watched from
outside: it connects to nothing beyond this machine, even when a foreign page opens a WebSocket to it; it stops
cleanly on SIGTERM and Ctrl-C, its worker processes with it; and after a SIGKILL its workers follow it and the next
start removes the temporary folder multiprocessing left behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from graphviz_core.config import config_from_preset
from graphviz_core.ui.links import config_params, link_url
from graphviz_core.ui.live import free_port, graph_frame, wait_healthy
from tests.conftest import captured, watched_page

ROOT = Path(__file__).resolve().parent.parent

# Imported by every Python process the server starts (PYTHONPATH): an audit hook that writes each network call, with
# its host, to the log the test reads. Audit hooks see every socket call, whichever library makes it.
AUDIT = """
import json, os, sys

_LOG = os.environ["NETWORK_AUDIT_LOG"]
_EVENTS = {"socket.connect", "socket.sendto", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr"}


def _host(event, args):
    if event in ("socket.connect", "socket.sendto"):
        address = args[1]
        return address[0] if isinstance(address, tuple) else None  # a Unix socket's path stays on this machine
    return args[0]


def _audit(event, args):
    if event in _EVENTS:
        host = _host(event, args)
        with open(_LOG, "a") as log:
            log.write(json.dumps({"pid": os.getpid(), "event": event, "host": host if host is None else str(host)}) + "\\n")


sys.addaudithook(_audit)
"""

LOOPBACK = {None, "", "localhost", "127.0.0.1", "::1", "0.0.0.0", "::"}


@contextlib.contextmanager
def served(env: dict | None = None, new_session: bool = False):
    """The app as `make serve` starts it, on a free localhost port: (process, URL); stopped (killed) afterwards."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "graphviz_core.ui.serve", "--server.port", str(port), "--server.address", "127.0.0.1",
         "--server.headless", "true", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
        cwd=ROOT, env={**os.environ, "GRAPHVIZ_CORE_DEVICE": "cpu", **(env or {})}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=new_session,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _foreign_websocket(url: str) -> str:
    """Open the app's WebSocket as a page on another site would (its Origin header); what the server answered."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    try:
        with connect(url.replace("http", "ws") + "/_stcore/stream", origin="http://attacker.example", open_timeout=30):
            return "accepted"
    except InvalidStatus as refused:
        return f"refused with HTTP {refused.response.status_code}"


@pytest.mark.browser
def test_a_session_and_a_foreign_websocket_make_no_outbound_connection(browser, tmp_path):
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(textwrap.dedent(AUDIT))
    log = tmp_path / "network.jsonl"
    env = {"PYTHONPATH": str(tmp_path / "shim"), "NETWORK_AUDIT_LOG": str(log)}
    with served(env) as (proc, url), watched_page(browser) as page:
        page.goto(url)
        graph_frame(page, captured("gpt2-tiny").summary.nodes)  # a real session: the default capture, drawn
        dry_run = config_from_preset("llama-tiny", device="meta").replace(preset="")  # starts the worker processes
        page.goto(link_url(url, config_params(dry_run)))
        graph_frame(page, captured("llama-tiny", device="meta").summary.nodes, timeout_s=120)
        assert _foreign_websocket(url) == "refused with HTTP 403"
        page.goto(url)  # the app's own page still connects
        graph_frame(page, captured("gpt2-tiny").summary.nodes)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls, "the audit hook saw no socket call at all: the shim did not load"
    outbound = [c for c in calls if c["host"] not in LOOPBACK and not c["host"].startswith("127.")]
    assert not outbound, outbound
