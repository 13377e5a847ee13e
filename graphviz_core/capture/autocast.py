"""Mixed precision as training runs it: the forward under `torch.autocast`, the weights left in the config's dtype
(fp32 master weights), float16 through a `torch.amp.GradScaler` (the loss scaled before backward, the optimizer
stepped through the scaler).

Autocast works through the CPU and CUDA dispatch keys; `meta` tensors have neither, so on a meta dry run autocast
would cast nothing. A dry run under autocast therefore runs on fake tensors (`FakeTensorMode`: shapes and dtypes,
no storage) that say they live on the device `auto` would pick: the model is built on meta as usual, then its
parameters and buffers become fake tensors of that device (`to_empty`), the batch too, and autocast casts them
exactly as it would real ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from graphviz_core.capture.device import resolve_device
from graphviz_core.capture.instrument import Run
from graphviz_core.capture.instruments.casts import AutocastCasts

AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_device_type(device: str) -> str:
    """The device type torch.autocast runs for: the capture's, or on meta the one `auto` would pick."""
    if device != "meta":
        return device
    try:
        picked = resolve_device("auto")
    except ValueError:
        picked = "cpu"
    return picked if picked != "meta" else ("cuda" if torch.cuda.is_available() else "cpu")


def autocast_observer(config) -> dict:
    """The instrument every autocast capture carries (the graph's `cast` category needs it), keyed by name."""
    return {"casts": AutocastCasts()} if config.autocast != "none" else {}


def uses_fake_tensors(run: Run) -> bool:
    return run.device == "meta" and run.config.autocast != "none"


@contextlib.contextmanager
def fake_device(run: Run) -> Iterator[None]:
    """Around the whole capture of a meta dry run under autocast: a FakeTensorMode (see the module docstring)."""
    if not uses_fake_tensors(run):
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def outside_fake_mode(run: Run) -> contextlib.AbstractContextManager:
    """Inside fake_device: the fake mode set aside (the model is built on plain meta tensors first)."""
    if not uses_fake_tensors(run):
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def on_fake_device(model: torch.nn.Module, batch: tuple, device_type: str) -> tuple[torch.nn.Module, tuple]:
    """The meta-built model and batch as fake tensors of `device_type` (inside fake_device). `to_empty` replaces
    parameters module by module, which splits a tied pair (an lm_head sharing the token embedding): tied again after."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device_type)
    for tied in owners.values():
        first_module, first_name = tied[0]
        for module, name in tied[1:]:
            setattr(module, name, getattr(first_module, first_name))
    return model, tuple(torch.zeros_like(t, device=device_type) for t in batch)


def autocast_context(run: Run) -> contextlib.AbstractContextManager:
    """torch.autocast for the forward (and the loss, as training computes it inside the autocast region)."""
    if run.config.autocast == "none":
        return contextlib.nullcontext()
    return torch.autocast(autocast_device_type(run.device), dtype=AUTOCAST_DTYPES[run.config.autocast])


def scaled(run: Run, loss: torch.Tensor) -> torch.Tensor:
    """What backward starts from: under float16 autocast the loss times the GradScaler's scale (run.scaler)."""
    if run.config.autocast != "float16":
        return loss
    run.scaler = torch.amp.GradScaler(autocast_device_type(run.device))
    return run.scaler.scale(loss)


def scaler_note(run: Run) -> str:
    """What the GradScaler did, before the optimizer's step adds its part ("" without one)."""
    if run.scaler is None:
        return ""
    if run.real:
        return (f"float16 autocast: the loss was multiplied by the GradScaler's scale {run.scaler.get_scale():,.0f} "
                "before backward (the gradients flowing through the graph are scaled by it; the gradient norms shown "
                "are divided by it again, as the optimizer steps with them).")
    return ("float16 autocast: the loss was multiplied by the GradScaler's scale (65,536 to start) before backward; "
            "on a dry run the scaler's inf/NaN check reads values fake tensors do not have, so the optimizer's state "
            "is counted as if the step ran.")
