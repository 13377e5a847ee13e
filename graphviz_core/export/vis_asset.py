"""Where pyvis keeps vis-network's files, and their copy in the app's `static/` folder: found without importing pyvis,
Streamlit or torch, so `make`'s set-up copies the script in a fraction of a second (importing them: about 4 s with no
bytecode yet). The renderer reads the files from here; `graphviz_core.ui.vis_script` serves the copy."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

_spec = importlib.util.find_spec("pyvis")
if _spec is None or _spec.origin is None:
    raise ModuleNotFoundError("pyvis is not installed: the graph pages draw with its copy of vis-network")
PYVIS_LIB = Path(_spec.origin).resolve().parent / "templates" / "lib" / "vis-9.1.2"
VIS_SCRIPT = PYVIS_LIB / "vis-network.min.js"
STATIC = Path(__file__).resolve().parents[2] / "static"  # beside app.py: Streamlit serves it at /app/static/
_log = logging.getLogger(__name__)


def publish(static: Path = STATIC) -> str | None:
    """Copy pyvis's vis-network.min.js into `static` unless it is there already, unchanged (`make run`, `make serve`
    and `make test` do this at set-up, so the server they start finds it and writes nothing); its content's digest,
    or None when it cannot be published."""
    target = static / VIS_SCRIPT.name
    script = VIS_SCRIPT.read_bytes()
    try:
        if not (target.exists() and target.read_bytes() == script):
            static.mkdir(exist_ok=True)
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            # copy2 keeps pyvis's modification time: the browser's cache then treats the file as long unchanged
            shutil.copy2(VIS_SCRIPT, partial)
            partial.replace(target)
    except OSError as error:
        _log.warning("vis-network is inlined into every graph frame: cannot publish it in %s (%s)", static, error)
        return None
    return hashlib.sha256(script).hexdigest()[:12]


if __name__ == "__main__":
    raise SystemExit(publish() is None)
