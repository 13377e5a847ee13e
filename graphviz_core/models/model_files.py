"""Loads your own `nn.Module` from a file's factory: any file the CLI or Python names, and in the web app only the
trusted folder's factories.

The web app imports no user code unless the server was started with GRAPHVIZ_CORE_TRUSTED_MODEL_DIR naming a
folder: then it offers that folder's factories (listed by parsing, never by a path a browser sends). The CLI and
Python callers, who already run code on their own machine, load any file they name.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from graphviz_core.models.family import Source


class UserError(ValueError):
    pass


def checked_loss(loss_fn: Callable[..., torch.Tensor], name: str) -> Callable[..., torch.Tensor]:
    """`loss_fn`, refusing with one sentence anything but a scalar tensor with a grad_fn."""

    def checked_loss(output):
        loss = loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            what = (
                type(loss).__name__
                if not isinstance(loss, torch.Tensor)
                else (f"a tensor of shape {tuple(loss.shape)}" if loss.numel() != 1 else "a tensor without a grad_fn")
            )
            raise UserError(f"{name}: the loss must be a scalar tensor with a grad_fn, got {what}.")
        return loss

    return checked_loss


def first_line(exc: BaseException) -> str:
    """The first line of `exc`'s message; on a server that imports trusted models, with every absolute path cut to
    its last part, so a browser never learns where the server keeps its files."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else "(no message)"
    return without_paths(line) if trusted_dir() is not None else line


# An absolute path (not the `/` of "3/4" or "a/b"): a slash not preceded by a word character, then names and slashes.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/(?:[^\s/'\"`:,;()<>]+/)*([^\s/'\"`:,;()<>]*)")


def without_paths(text: str) -> str:
    """`text` with each absolute path replaced by its last part (`/srv/models/net.py` -> `net.py`)."""
    return _ABSOLUTE_PATH.sub(lambda m: m.group(1) or "/", text)


class ExitCalled(BaseException):
    """os._exit(code), called by a model file's code while `user_code_apart` runs it: raised in its place, so that the
    program says what the file did instead of ending with nothing written."""

    def __init__(self, code: object) -> None:
        super().__init__(code)
        self.code = code


@dataclass
class UserCodeReport:
    """What a model file's code did to the process while `user_code_apart` ran it."""

    printed: int = 0  # characters it wrote to sys.stdout (sent to stderr instead)
    replaced: list[str] = field(default_factory=list)  # "sys.stdout", "sys.stderr": set by it, put back after
    threads: list[threading.Thread] = field(default_factory=list)  # non-daemon threads it left running


class _ToStderr(io.TextIOBase):
    """sys.stdout while a model file's code runs: its prints go to stderr, counted."""

    def __init__(self, target, report: UserCodeReport) -> None:
        self.target, self.report = target, report

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.report.printed += len(text)
        return self.target.write(text)

    def flush(self) -> None:
        self.target.flush()


@contextlib.contextmanager
def user_code_apart() -> Iterator[UserCodeReport]:
    """Run a model file's code with stdout kept for the tool's own output (JSON): what it prints (sys.stdout, and
    writes to file descriptor 1 where there is one) goes to stderr, sys.stdout and sys.stderr are put back whatever it
    set them to (a file that set sys.stdout = None made the JSON's write fail), and os._exit raises ExitCalled (it
    ended the program with exit code 0 and nothing written). The report says what it did, and names the non-daemon
    threads it started that still run (Python would wait for them at exit, after the output)."""
    report = UserCodeReport()
    out, err, exit_ = sys.stdout, sys.stderr, os._exit
    before = set(threading.enumerate())
    redirected = _ToStderr(err, report)
    saved_fd = None
    with contextlib.suppress(AttributeError, OSError, ValueError):
        out.flush()
        err.flush()
        saved_fd = os.dup(1)
        os.dup2(2, 1)

    def exit_called(code: int) -> None:
        raise ExitCalled(code)

    sys.stdout, os._exit = redirected, exit_called
    try:
        yield report
    finally:
        for name, ours in (("sys.stdout", redirected), ("sys.stderr", err)):
            if getattr(sys, name.split(".")[1]) is not ours:
                report.replaced.append(name)
        with contextlib.suppress(AttributeError, OSError, ValueError):
            redirected.flush()
        sys.stdout, sys.stderr, os._exit = out, err, exit_
        if saved_fd is not None:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
        report.threads = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]


def load_factory(spec: str) -> tuple[nn.Module, tuple, Callable]:
    """Import `PATH:FACTORY` and call the factory, which returns (module, example inputs, loss function)."""
    path_text, sep, factory_name = spec.rpartition(":")
    if not sep or not path_text or not factory_name:
        raise ValueError(f"--model-file takes PATH:FACTORY (e.g. models/my_net.py:make), got {spec!r}.")
    path = Path(path_text)
    if not path.is_file():
        what = ("is a folder, not a Python file" if path.is_dir() else
                "is not a regular file (a FIFO, socket or device), not a Python file" if path.exists() else
                "does not exist")
        raise ValueError(f"model file {path_text} {what}.")
    module_name = f"graphviz_core_user_{abs(hash(path.resolve()))}"
    try:
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"model file {path_text} is not a Python file.")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        loader_spec.loader.exec_module(module)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"importing {path_text} raised {type(exc).__name__}: {first_line(exc)}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"{path_text} has no function {factory_name!r}.")
    try:
        made = factory()
    except Exception as exc:
        raise ValueError(f"{factory_name}() raised {type(exc).__name__}: {first_line(exc)}") from None
    if not isinstance(made, tuple) or len(made) != 3:
        raise ValueError(
            f"{factory_name}() must return (module, example inputs, loss function), "
            f"got {type(made).__name__}{' of length ' + str(len(made)) if isinstance(made, tuple) else ''}."
        )
    return made


TRUSTED_DIR_ENV = "GRAPHVIZ_CORE_TRUSTED_MODEL_DIR"


def trusted_dir() -> Path | None:
    """The folder whose model files the web app may import: only when the server was started with
    GRAPHVIZ_CORE_TRUSTED_MODEL_DIR naming it (an explicit opt-in); None otherwise."""
    value = os.environ.get(TRUSTED_DIR_ENV, "").strip()
    if not value:
        return None
    path = Path(value).resolve()
    return path if path.is_dir() else None


def _inside(folder: Path, name: str) -> Path | None:
    """The file `name` in `folder`, symbolic links followed, or None when it is not a file or lies outside the
    folder (a link to code elsewhere is not code the operator put there)."""
    path = (folder / name).resolve()
    return path if path.is_file() and path.is_relative_to(folder) else None


def trusted_factories() -> list[str]:
    """`file.py:function` for every top-level function without required arguments in the trusted folder's
    .py files that lie inside it (links resolved), found by parsing (nothing is imported to list them)."""
    folder = trusted_dir()
    if folder is None:
        return []
    found = []
    for path in sorted(p for p in folder.glob("*.py") if _inside(folder, p.name) is not None):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                args = node.args
                required = len(args.posonlyargs) + len(args.args) - len(args.defaults)
                if required == 0 and not [d for d in args.kw_defaults if d is None]:
                    found.append(f"{path.name}:{node.name}")
    return found


def trusted_source(spec: str) -> Source:
    """The model, inputs and loss of `file.py:function` from the trusted folder, refused unless the opt-in is on
    and the name is one `trusted_factories` lists (so no path from a browser reaches the file system)."""
    if trusted_dir() is None:
        raise ValueError(
            f"this server runs no user code; start it with {TRUSTED_DIR_ENV}=FOLDER to allow the models in FOLDER."
        )
    folder = trusted_dir()
    if folder is None or spec not in trusted_factories():
        raise ValueError(f"{spec!r} is not a model in the trusted folder.")
    file_name, _, function = spec.partition(":")
    path = _inside(folder, file_name)
    if path is None:  # the listing and this load look at the folder at two moments: a link may have changed between
        raise ValueError(f"{spec!r} is not a model in the trusted folder.")
    try:
        model, inputs, loss_fn = load_factory(f"{path}:{function}")
    except ValueError as exc:  # its sentences name the file by its path on this server: name it as the list does
        raise ValueError(without_paths(str(exc).replace(str(path), file_name))) from None
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    return Source(model.train(), inputs, checked_loss(loss_fn, spec))
