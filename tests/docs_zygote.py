"""A warm `graphviz-core` for the docs' commands (tests/test_docs_commands.py): one process imports the package, torch
and transformers' model modules once, then forks a child per command that runs the CLI as `.venv/bin/graphviz-core`
would, on the caller's own stdin, stdout and stderr (passed over a Unix socket), in its directory and environment,
and returns its exit status. The commands run as written; what each saves is the 2-4 s every fresh process spends
importing before its first line of work (about 100 documented commands).

Run as `python tests/docs_zygote.py SOCKET`; prints "ready" once it listens. `shim(SOCKET)` is the text of the
executable that stands in for .venv/bin/graphviz-core.

The other tests that run the CLI as a program (`python -m graphviz_core ...`: its exit status, its stderr, its files)
call `run_cli`, which does the same through one warm process per pytest worker, started at the first call: the child
starts as `python -m graphviz_core` would, its directory first on sys.path and then PYTHONPATH's entries. A test that
signals the program itself (Ctrl-C) still starts a process of its own: the signal would reach the stand-in."""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

HEADER = struct.Struct("!I")  # the request's length, then the request (JSON: argv, cwd, env)


def preload() -> None:
    """Each family's modules (transformers' modeling files among them), then a CPU capture's one-time costs paid here
    once instead of in every command's child: each family's tiny twin at float32 (engine._warm_family, whose first
    capture runs the process's warm-up, its full collection and freeze included). The docs' commands: 91 s of CPU
    with those costs in every child, 87 s without. The twins only with one torch thread (`make test` sets
    OMP_NUM_THREADS=1): a fork after OpenMP started threads would leave the child's pool unusable."""
    import torch

    import graphviz_core.cli  # noqa: F401
    from graphviz_core.capture import engine
    from graphviz_core.config import FAMILIES, config_from_preset
    from graphviz_core.export import formats  # noqa: F401
    from graphviz_core.models.registry import build_model
    from graphviz_core.parallel import pipeline, planner  # noqa: F401

    presets = [family.presets[0].name for family in FAMILIES.values() if family.presets]
    for name in presets:
        build_model(config_from_preset(name, device="meta"))
    if torch.get_num_threads() == 1:
        for name in presets:
            engine._warm_family(config_from_preset(name, device="cpu"), "cpu")


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("the request ended early")
        data += more
    (size,) = HEADER.unpack_from(data)
    return json.loads(data[HEADER.size:HEADER.size + size]), fds


def _child(request: dict, fds: list[int]) -> int:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    if request.get("as_module"):  # `python -m graphviz_core`: its directory, then PYTHONPATH, ahead of the rest
        sys.path[0:1] = [request["cwd"], *[p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]]
    from graphviz_core.cli import main

    try:
        code = main(sys.argv[1:])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # as the interpreter ends a program on an uncaught exception: its traceback, exit 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return int(code or 0)


def serve(path: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    waiting: dict[int, socket.socket] = {}  # child pid -> the caller's connection
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    parent = os.getppid()
    while os.getppid() == parent:  # ends with the process that started it, however that one ended
        for _ in selector.select(timeout=0.05):
            conn, _ = server.accept()
            request, fds = _read_request(conn)
            pid = os.fork()
            if pid == 0:
                code = 70  # EX_SOFTWARE, if the CLI itself raised
                try:
                    server.close()
                    conn.close()
                    code = _child(request, fds)
                finally:
                    os._exit(code)
            for fd in fds:
                os.close(fd)
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            conn = waiting.pop(pid)
            conn.sendall(str(code).encode())  # a signal that ended it as waitstatus_to_exitcode gives it: -9
            conn.close()


def shim(path: str, as_module: bool = False) -> str:
    """The stand-in for .venv/bin/graphviz-core (or, `as_module`, for `python -m graphviz_core`): hand argv, the
    directory, the environment and fds 0-2 to the warm process, then exit with the command's status."""
    return f"""#!{sys._base_executable} -S
import json, os, socket, struct, sys
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect({path!r})
body = json.dumps({{"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "as_module": {as_module!r}}}).encode()
socket.send_fds(conn, [struct.pack("!I", len(body)) + body], [0, 1, 2])
status = b""
while True:
    got = conn.recv(16)
    if not got:
        break
    status += got
code = int(status or 70)
if code < 0:  # ended by a signal: end this process by the same one, as the caller would have seen the program end
    import signal
    if -code not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose handling cannot change
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def start(sock: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A warm process listening on `sock`, in the repository with `env` (this process's by default), once it says
    "ready"; stop it with `warm.terminate()`."""
    root = Path(__file__).resolve().parent.parent
    warm = subprocess.Popen([str(root / ".venv" / "bin" / "python"), __file__, sock], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if warm.stdout.readline().strip() != "ready":
        warm.kill()
        raise RuntimeError("the warm graphviz-core did not start")
    return warm


_WARM: dict[str, str] = {}


def _warm_shim() -> str:
    """The stand-in for `python -m graphviz_core` served by this process's warm process, started at the first call
    and stopped when this process exits."""
    if "shim" not in _WARM:
        place = Path(tempfile.mkdtemp(prefix="graphviz-core-cli-"))
        sock = str(place / "zygote.sock")
        warm = start(sock)

        def stop() -> None:
            warm.terminate()
            warm.wait(timeout=30)
            shutil.rmtree(place, ignore_errors=True)

        atexit.register(stop)
        stand_in = place / "graphviz-core"
        stand_in.write_text(shim(sock, as_module=True))
        stand_in.chmod(0o755)
        _WARM["shim"] = str(stand_in)
    return _WARM["shim"]


def run_cli(args, **kwargs) -> subprocess.CompletedProcess:
    """`python -m graphviz_core *args` as subprocess.run(..., **kwargs) runs it, its output captured as text unless
    asked otherwise: its own process (forked from the warm one), stdin, stdout, stderr, directory, environment and
    exit status."""
    return subprocess.run([_warm_shim(), *args], **{"capture_output": True, "text": True, **kwargs})


if __name__ == "__main__":
    preload()
    serve(sys.argv[1])
