"""Captures your own `nn.Module`: from Python (`capture_module`) or from a file's factory (`--model-file PATH:FACTORY`).

Loading a factory file (and the web app's trusted folder) is graphviz_core.models.model_files's part.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from graphviz_core.capture.engine import Progress, capture_backward
from graphviz_core.capture.result import Capture
from graphviz_core.config import CUSTOM, ModelConfig
from graphviz_core.models.family import Source
from graphviz_core.models.model_files import checked_loss, load_factory


def capture_module(
    model: nn.Module,
    inputs: torch.Tensor | tuple,
    loss_fn: Callable[..., torch.Tensor],
    name: str = "your model",
    progress: Progress | None = None,
    compile: bool = False,
) -> Capture:
    """One instrumented forward + backward of `model(*inputs)`, with `loss_fn(output)` as the loss.

    The model runs where its parameters are (cpu, cuda or meta); the Capture is the same as for a built-in model,
    with model "custom" and `config.preset` naming it; `compile` captures the step under torch.compile
    (graphviz_core.capture.compiled). Raises ValueError with one sentence when the
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
        compile=compile,
    )
    return capture_backward(config, progress, source=Source(model.train(), inputs, checked_loss(loss_fn, name)))


def capture_file(spec: str, progress: Progress | None = None) -> Capture:
    """`--model-file PATH:FACTORY`: load the factory's three things and capture them."""
    model, inputs, loss_fn = load_factory(spec)
    return capture_module(model, inputs, loss_fn, name=spec, progress=progress)


