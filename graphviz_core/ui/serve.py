"""Start the web app the way `make run` and `make serve` do: `python -m graphviz_core.ui.serve [streamlit options]`.

The same as `streamlit run app.py [options]`, plus:
- while Streamlit's server starts and the first browser loads its frontend, a background thread imports what the
  first graph needs (torch, the graph view; seconds on a small machine) and pays the process's one-time capture costs
  (graphviz_core.capture.engine.warm_up); once the first capture is in, it imports the other panels (pandas,
  Altair). The first page then finds them done instead of starting them when the first visitor arrives;
- no outbound connection: Streamlit's lookups of this machine's addresses are replaced (no_outbound_lookups);
- a clean stop: on SIGTERM or Ctrl-C, captures in flight are cancelled, the worker processes end, exit status 0
  (main); what a killed server left in the temporary folder is removed at the next start (remove_stale_temp_dirs).
Same app, same options, same process.
"""

from __future__ import annotations

import atexit
import importlib
import os
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app.py"
# What the explorer's first graph needs, heaviest first (torch comes with the first): imported before the warm-up
FIRST_GRAPH = (
    "graphviz_core.capture.engine",
    "graphviz_core.ui.capture_cache",
    "graphviz_core.ui.config_form",
    "graphviz_core.ui.summary",
    "graphviz_core.ui.graph_view",
)
# The other tabs' panels (pandas, Altair: ~0.7 s here): imported once the first capture is in, so the first graph
# is not kept waiting for them (the explorer imports a panel when its tab opens, pages/graph_explorer.py)
PANELS = ("graphviz_core.ui.memory_view", "graphviz_core.ui.flops_view", "graphviz_core.ui.textbook_view")
PANELS_AFTER_S = 30  # or after this long without a capture (nobody opened the explorer)
# and this long after the first capture is in: its page is still rendering and its browser drawing the graph then,
# and imports hold the interpreter lock (on two cores they would also take one from the browser)
PANELS_SETTLE_S = 2.0


def _import(names: tuple[str, ...]) -> None:
    for name in names:
        importlib.import_module(name)


# The Recordings page (graphviz_core.ui.recordings_view): a server given this folder lists and opens only the recordings
# in it; without it (a person's own machine) the page takes a folder's path or a .zip of one, up to MAX_UPLOAD_BYTES.
RECORDINGS_ENV = "GRAPHVIZ_CORE_RECORDINGS"
MAX_UPLOAD_BYTES = 200 * 2**20


def upload_options(argv: list[str]) -> list[str]:
    """The server-wide upload limit the Recordings page's .zip box needs, where the page offers it (no recordings
    folder given) and the options do not set one: Streamlit refuses any upload over `server.maxUploadSize` (1 MB in
    .streamlit/config.toml) whatever the box's own limit, so a 1.8 MB recording came back "Request failed with
    status code 413"."""
    if os.environ.get(RECORDINGS_ENV, "").strip() or any(a.startswith("--server.maxUploadSize") for a in argv):
        return []
    return ["--server.maxUploadSize", str(MAX_UPLOAD_BYTES // 2**20)]


SERVER_UP_WAIT_S = 5.0  # the longest the imports wait for the server to answer first
_STOPPING = threading.Event()  # the server is stopping: the preload thread starts nothing more


def _server_up() -> None:
    """Until Streamlit's server is listening (at most SERVER_UP_WAIT_S): its start and these imports are both Python
    and take turns on the interpreter lock, so importing torch meanwhile held the server's first answer back (1.09 s
    to health, cold start 3.4 s); the browser's ~1 s of script then runs while torch imports. main() imports
    streamlit before this thread starts: importing it here while the main thread does broke the server's start."""
    from streamlit.runtime import Runtime, RuntimeState

    deadline = time.monotonic() + SERVER_UP_WAIT_S
    while time.monotonic() < deadline:
        if Runtime.exists() and Runtime.instance().state != RuntimeState.INITIAL:
            return
        time.sleep(0.02)


def preload() -> None:
    """Once the server listens, import the first graph's modules, warm the capture path on the device `auto` picks,
    then import the other panels once the first capture is in (errors are left for the page to meet and report:
    this only saves time)."""
    try:
        _server_up()
        from graphviz_core.capture.device import resolve_device
        from graphviz_core.capture.engine import warm_up

        device = resolve_device("auto")
        # The imports run under the warm-up's lock: a first capture that starts meanwhile waits for them rather
        # than have its timed forward share the CPU with them, which would inflate the time it shows many times over.
        warm_up(device, before=lambda: _import(FIRST_GRAPH))
        from graphviz_core.serve.shared_captures import shared_captures

        deadline = time.monotonic() + PANELS_AFTER_S
        while shared_captures().load().entries == 0 and time.monotonic() < deadline and not _STOPPING.is_set():
            time.sleep(0.1)
        if _STOPPING.wait(PANELS_SETTLE_S):
            return
        # under the same lock: a capture that starts while they import waits for them (warm_up returns at once)
        warm_up(device, before=lambda: _import(PANELS))
    except Exception:  # noqa: BLE001 - the page imports the same modules and shows any error itself
        pass


def _bound_address() -> str | None:
    """The address the server listens on when the operator named one (`make serve HOST=10.0.0.5`), else None."""
    from streamlit import config
    from streamlit.web.server import server_address_is_unix_socket

    address = config.get_option("server.address")
    if not address or address in ("0.0.0.0", "::") or server_address_is_unix_socket():  # noqa: S104 - compared
        return None
    return address


def no_outbound_lookups() -> None:
    """Keep Streamlit from asking the network for this machine's addresses.

    Streamlit's net_util finds the "internal IP" by connecting a UDP socket to 8.8.8.8 and the "external IP" by an
    HTTP request to checkip.amazonaws.com. It asks them to print "Network URL" / "External URL" at start (when no
    address is named) and, for every WebSocket whose Origin is not this page's own host, to see whether that origin
    is this machine (streamlit/web/server/server_util.py, is_url_from_allowed_origins): any foreign page could make a
    server on an isolated network reach out. No setting turns either off, so both are replaced before the server
    starts: the internal address is the one the server binds to when the operator names one, the external one is
    unknown. Same-origin pages (the app's own, and through a proxy that passes Host) never reach these checks.
    """
    from streamlit import net_util

    net_util.get_internal_ip = _bound_address
    net_util.get_external_ip = lambda: None


def remove_stale_temp_dirs(folder: Path | None = None) -> list[Path]:
    """Remove the temporary folders (`pymp-*`) that multiprocessing left behind in `folder` (the system's temporary
    folder) when the process that made them was killed; the removed folders.

    A fork server keeps its socket in one (`listener-*`); its process removes it when it ends, unless it was killed.
    Only folders of this user that hold nothing but sockets no process listens on any more (/proc/net/unix) are
    removed, so a folder some live process still uses is never touched. Elsewhere than Linux, nothing is removed."""
    listening = _listening_unix_sockets()
    if listening is None:
        return []
    removed = []
    for candidate in sorted(Path(folder or tempfile.gettempdir()).glob("pymp-*")):
        try:
            if candidate.is_symlink() or not candidate.is_dir() or candidate.stat().st_uid != os.getuid():
                continue
            entries = list(candidate.iterdir())
            if not entries or any(not stat.S_ISSOCK(e.lstat().st_mode) or str(e) in listening for e in entries):
                continue
            for entry in entries:
                entry.unlink()
            candidate.rmdir()
            removed.append(candidate)
        except OSError:  # another process removed or used it meanwhile: leave it
            continue
    return removed


def _listening_unix_sockets() -> set[str] | None:
    """Paths of the Unix sockets some process holds open (Linux /proc/net/unix); None where it cannot be read."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return None
    return {fields[7] for fields in (line.split() for line in lines) if len(fields) >= 8}


STOP_WAIT_S = 10.0  # the longest a stopping server waits for its captures, then for its worker processes


def shut_down(preloading: threading.Thread | None = None) -> None:
    """Stop what runs besides Streamlit, once its server has stopped: every capture in flight is cancelled and waited
    for (each stops at its next module or autograd node), the preload thread ends, the worker processes end."""
    _STOPPING.set()
    deadline = time.monotonic() + STOP_WAIT_S
    shared = sys.modules.get("graphviz_core.serve.shared_captures")  # not imported: nothing was captured
    if shared is not None:
        for job in shared.shared_captures().cancel_all("cancelled: the server is stopping"):
            job.done.wait(max(0.0, deadline - time.monotonic()))
    if preloading is not None:
        preloading.join(max(0.0, deadline - time.monotonic()))
    workers = sys.modules.get("graphviz_core.capture.workers")
    if workers is not None:
        workers.shut_down_workers(STOP_WAIT_S)


def main(argv: list[str] | None = None) -> None:
    """Start the app; on SIGTERM or Ctrl-C (Streamlit's handlers stop its server), stop everything else, then exit.

    The exit skips the C++ destructors that run after Python's own: a thread still inside a torch kernel then (a
    page's computation Streamlit could not stop) met a destroyed thread pool, and the process ended in SIGABRT
    ("terminate called without an active exception"). Python's exit handlers still run first (multiprocessing's
    clean-up, logging's flush)."""
    from streamlit.runtime import Runtime  # noqa: F401 - imported here, before the preload thread needs it
    from streamlit.web import cli

    remove_stale_temp_dirs()  # what a server killed with SIGKILL left in /tmp
    no_outbound_lookups()
    # Each page's URL answered with the app's page (graphviz_core.ui.routes), so the frontend never probes
    # /<page>/_stcore/health and host-config (two 404s and console errors per page opened by its URL).
    from graphviz_core.ui.routes import install as install_page_routes

    install_page_routes()
    preloading = threading.Thread(target=preload, name="preload", daemon=True)
    preloading.start()
    code = 0
    try:
        options = sys.argv[1:] if argv is None else argv
        cli.main(["run", str(APP), *options, *upload_options(options)], prog_name="streamlit")
    except SystemExit as stop:  # click ends every command this way, 0 after a server stopped by a signal
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        shut_down(preloading)
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)


if __name__ == "__main__":
    main()
