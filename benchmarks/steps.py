"""The steps the overhead benchmarks time against each other: a bare step, a capture, and the floor.

`bare_step` builds the model and runs forward, loss and backward with no instrumentation; `captured_step` runs
graphviz_core.capture.engine on the same config. The floor is the least a capture built like graphviz_core.capture.engine can
cost: its mechanism installed, recording nothing.

The capture sees every aten op through a Python dispatch mode, every module call through forward pre/post hooks,
every saved tensor through saved-tensor hooks and every autograd node through pre/post hooks. `floor_step` installs
exactly those, each doing nothing, around the same build + forward + loss + backward as a bare step: what is left
between it and a bare step is the price of the mechanism (Python called per op and per node), which no change to what
the capture records can remove; what is left between it and the capture is the recording itself.
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphviz_core.capture.engine import capture_backward
from graphviz_core.capture.walk import autograd_nodes
from graphviz_core.config import ModelConfig
from graphviz_core.models.registry import build_model, compute_loss, make_batch


class _Passthrough(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as the capture's own mode: no torch._dynamo frame per call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _nothing(*args, **kwargs) -> None:
    return None


def _same(t):
    return t


def floor_step(config: ModelConfig) -> float:
    """Seconds of build + forward + loss + backward with the capture's hooks and dispatch mode, all empty."""
    started = time.perf_counter()
    model = build_model(config)
    batch = make_batch(config, "cpu")
    handles = [m.register_forward_pre_hook(_nothing, with_kwargs=True) for m in model.modules()]
    handles += [m.register_forward_hook(_nothing, with_kwargs=True, always_call=True) for m in model.modules()]
    with torch.autograd.graph.saved_tensors_hooks(_same, _same), _Passthrough():
        loss = compute_loss(config, model(batch.inputs), batch.targets)
    for node in autograd_nodes(loss.grad_fn):
        handles.append(node.register_prehook(_nothing))
        handles.append(node.register_hook(_nothing))
    with _Passthrough():
        loss.backward()
    for handle in handles:
        handle.remove()
    took = time.perf_counter() - started
    del model, batch, loss
    return took


def bare_step(config: ModelConfig) -> float:
    """Seconds of build + forward + loss + backward with no instrumentation: what the capture does."""
    started = time.perf_counter()
    model = build_model(config)
    batch = make_batch(config, "cpu")
    compute_loss(config, model(batch.inputs), batch.targets).backward()
    del model, batch
    return time.perf_counter() - started


def captured_step(config: ModelConfig, instruments=None) -> float:
    """Seconds of one capture (it builds the model itself); `instruments` as capture_backward takes them (None: all)."""
    started = time.perf_counter()
    capture = capture_backward(config, instruments=instruments)
    del capture
    return time.perf_counter() - started
