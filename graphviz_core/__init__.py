"""graphviz_core: capture a real backward pass, annotate its autograd graph, and explain what it costs.

The public API, imported lazily (importing this package imports no torch, no Streamlit, no pyvis, and never
initialises CUDA)::

    import graphviz_core as gc

    config = gc.resolve_config("llama-tiny", layers=4)     # a validated ModelConfig: a preset plus fields
    model, batch, loss_fn = gc.build(config)               # the model, its example batch, and the loss
    loss = loss_fn(model, batch)                           # the forward, exactly as the capture runs it
    capture = gc.capture_backward(config)                  # one instrumented forward + backward: a Capture
    capture = gc.capture_module(my_module, inputs, my_loss)  # your own nn.Module
    with gc.record("runs/exp1", steps=100) as rec: ...     # your own training loop, step after step

See docs/api.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["build", "capture_backward", "capture_module", "family_of", "record", "resolve_config"]

if TYPE_CHECKING:
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.capture.own_module import capture_module
    from graphviz_core.capture.recorder import record
    from graphviz_core.config import resolve_config
    from graphviz_core.models.registry import family_of

_LAZY = {
    "capture_backward": "graphviz_core.capture.engine",
    "capture_module": "graphviz_core.capture.own_module",
    "record": "graphviz_core.capture.recorder",
    "resolve_config": "graphviz_core.config",
    "family_of": "graphviz_core.models.registry",
}


def build(config):
    """`(model, batch, loss_fn)` for `config`, on the device the capture would use (`auto`: CUDA if there is one,
    else CPU; `meta` builds shapes only). `loss_fn(model, batch)` runs the forward and returns the scalar loss exactly
    as `capture_backward` does: the family's loss of `model(batch.inputs)` against `batch.targets`, computed outside
    the model's forward."""
    import torch

    from graphviz_core.capture.device import resolve_device
    from graphviz_core.models.registry import build_model, family_of, make_batch

    device = resolve_device(config.device)
    family = family_of(config)
    with torch.device(device):
        model = build_model(config)
    batch = make_batch(config, device)

    def loss_fn(model, batch):
        return family.loss(config, model(batch.inputs), batch.targets)

    return model, batch, loss_fn


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graphviz_core' has no attribute {name!r}")
