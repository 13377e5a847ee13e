"""Captures your own `nn.Module`: from Python (`capture_module`) or from a file's factory (`--model-file PATH:FACTORY`).

The web app never calls this: a shared server must not run code that a browser names. Only the CLI and
Python callers, who already run code on their own machine, load a user's file.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from graphviz_core.capture import Capture, Progress, Source, capture_backward
from graphviz_core.config import CUSTOM, ModelConfig


def capture_module(
    model: nn.Module,
    inputs: torch.Tensor | tuple,
    loss_fn: Callable[..., torch.Tensor],
    name: str = "your model",
    progress: Progress | None = None,
) -> Capture:
    """One instrumented forward + backward of `model(*inputs)`, with `loss_fn(output)` as the loss.

    The model runs where its parameters are (cpu, cuda or meta); the Capture is the same as for a built-in model,
    with `config.model == "custom"` and `config.preset` naming it. Raises ValueError with one sentence when the
    three things are not what they should be or when the model raises.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"{name}: expected an nn.Module first, got {type(model).__name__}.")
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise ValueError(f"{name}: example inputs must be a tensor or a tuple of tensors.")
    if not callable(loss_fn):
        raise ValueError(f"{name}: the loss function is not callable (got {type(loss_fn).__name__}).")
    first = next(model.parameters(), None)
    device = (first.device if first is not None else inputs[0].device if inputs else torch.device("cpu")).type
    dtype = str(first.dtype).removeprefix("torch.") if first is not None else "float32"
    batch = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 1
    config = ModelConfig(
        model=CUSTOM,
        device=device if device in ("cpu", "cuda", "meta") else "cpu",
        dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32",
        batch=max(batch, 1),
        preset=name,
    )

    def checked_loss(output):
        loss = loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            what = (
                type(loss).__name__
                if not isinstance(loss, torch.Tensor)
                else (f"a tensor of shape {tuple(loss.shape)}" if loss.numel() != 1 else "a tensor without a grad_fn")
            )
            raise _UserError(f"{name}: the loss must be a scalar tensor with a grad_fn, got {what}.")
        return loss

    model.train()
    try:
        return capture_backward(config, progress, source=Source(model, inputs, checked_loss))
    except _UserError as exc:
        raise ValueError(str(exc)) from None
    except ValueError:
        raise
    except Exception as exc:  # the user's forward or loss raised: one sentence, no traceback
        raise ValueError(f"{name} raised {type(exc).__name__} during the capture: {_first_line(exc)}") from None


class _UserError(Exception):
    pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def load_factory(spec: str) -> tuple[nn.Module, tuple, Callable]:
    """Import `PATH:FACTORY` and call the factory, which returns (module, example inputs, loss function)."""
    path_text, sep, factory_name = spec.rpartition(":")
    if not sep or not path_text or not factory_name:
        raise ValueError(f"--model-file takes PATH:FACTORY (e.g. models/my_net.py:make), got {spec!r}.")
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"model file {path_text} does not exist.")
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
        raise ValueError(f"importing {path_text} raised {type(exc).__name__}: {_first_line(exc)}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"{path_text} has no function {factory_name!r}.")
    try:
        made = factory()
    except Exception as exc:
        raise ValueError(f"{factory_name}() raised {type(exc).__name__}: {_first_line(exc)}") from None
    if not isinstance(made, tuple) or len(made) != 3:
        raise ValueError(
            f"{factory_name}() must return (module, example inputs, loss function), "
            f"got {type(made).__name__}{' of length ' + str(len(made)) if isinstance(made, tuple) else ''}."
        )
    return made


def capture_file(spec: str, progress: Progress | None = None) -> Capture:
    """`--model-file PATH:FACTORY`: load the factory's three things and capture them."""
    model, inputs, loss_fn = load_factory(spec)
    return capture_module(model, inputs, loss_fn, name=spec, progress=progress)
