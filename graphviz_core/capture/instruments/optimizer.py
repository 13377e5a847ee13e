"""The optimizer's state: the config's `torch.optim` optimizer over the captured parameters, one step on their
gradients, and the bytes of every tensor it keeps afterwards (read from `optimizer.state`, not a multiplier).

On CPU and CUDA the step runs on the real gradients (under float16 autocast through the run's GradScaler, as
training does). On `meta` the state still comes from torch.optim's own code: `step()` builds it (`_init_group`)
with the shapes and dtypes a real step gives; where the update itself then needs a value (Adafactor's update-norm
clipping calls `.item()`), what it built is read and the note says so.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphviz_core.capture.instrument import Instrument, Run
from graphviz_core.capture.result import OptimizerState

OPTIMIZER_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "sgd-momentum": "SGD with momentum",
                   "adafactor": "Adafactor"}
# State tensors shaped like a parameter that each optimizer keeps (Adam's two moments, SGD's momentum buffer;
# Adafactor's row and column factors are far smaller and counted as none)
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2, "adafactor": 0}
LEARNING_RATE = 1e-3  # any value: the state's size does not depend on it


def make_optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The torch.optim optimizer `name` (graphviz_core.config.OPTIMIZERS) with torch's defaults otherwise."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LEARNING_RATE)
    if name == "adam":
        return torch.optim.Adam(params, lr=LEARNING_RATE)
    if name == "sgd":
        return torch.optim.SGD(params, lr=LEARNING_RATE)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=LEARNING_RATE)
    raise ValueError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZER_NAMES)}.")


def state_of(optimizer: torch.optim.Optimizer) -> tuple[int, dict[str, int], int]:
    """(bytes, bytes per state key, tensors) of everything `optimizer.state` holds, each storage once."""
    seen: set[int] = set()
    by_key: dict[str, int] = {}
    tensors = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            tensors += 1
            storage = value.untyped_storage()
            if storage._cdata in seen:
                continue
            seen.add(storage._cdata)
            by_key[key] = by_key.get(key, 0) + value.numel() * value.element_size()
    return sum(by_key.values()), dict(sorted(by_key.items())), tensors


class OptimizerStep(Instrument):
    """After the backward: the config's optimizer, one step, its state's bytes (`result`)."""

    name = "optimizer"

    def start(self, run: Run) -> None:
        super().start(run)
        self.result: OptimizerState | None = None

    def after_backward(self, run: Run) -> None:
        name = run.config.optimizer
        params = [p for p in run.model.parameters() if p.grad is not None]
        if not params:
            return
        notes: list[str] = []
        if any(p.dtype != torch.float32 for p in params):
            params = _master_copies(params)
            notes.append(f"The weights are {run.config.dtype}: the optimizer stepped fp32 master copies of them, as "
                         "mixed-precision training does, so its state is fp32.")
        optimizer = make_optimizer(name, params)
        # Bookkeeping after the measured backward: no dispatch mode of the capture is active here.
        stepped = _step(optimizer, run, notes)
        if any(p not in optimizer.state for p in params) and name != "sgd":
            raise ValueError(f"{OPTIMIZER_NAMES[name]} built no state for some parameters on {run.device}; "
                             "run the capture on cpu to read its state.")
        state_bytes, by_key, tensors = state_of(optimizer)
        timeline = run.instrument("timeline")
        held = timeline.live_bytes() if timeline is not None else None
        update = update_bytes(optimizer, params)
        self.result = OptimizerState(name, state_bytes, by_key, tensors, len(params),
                                     sum(p.numel() for p in params), stepped, tuple(notes), held, update)
        optimizer.state.clear()


class _NewStorages(TorchDispatchMode):
    """The most bytes of storages that ops create while it is on and that are still alive, counted from when it starts
    (storages that existed before, such as the weights an in-place update writes, are not new). A storage is known by
    its address while it lives; a freed one's address may come back for the next."""

    def __init__(self, existing: set[int]) -> None:
        super().__init__()
        self.existing = existing  # addresses of the weights, gradients and state: alive through the step
        self.live: dict[int, tuple[int, int]] = {}  # id(weak reference) -> (address, bytes)
        self.addresses: set[int] = set()
        self.refs: list[weakref.ref] = []
        self.bytes = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self.existing or key in self.addresses:
                    continue
                ref = weakref.ref(storage, self._freed)
                self.refs.append(ref)
                self.addresses.add(key)
                self.live[id(ref)] = (key, storage.nbytes())
                self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        return out

    def _freed(self, ref: weakref.ref) -> None:
        key, nbytes = self.live.pop(id(ref), (None, 0))
        self.addresses.discard(key)
        self.bytes -= nbytes


def update_bytes(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> int | None:
    """The most bytes one steady-state update allocates beyond the state it keeps (AdamW's denominator and step
    size per parameter, on CPU one parameter at a time), measured on a second step over the same gradients (the first
    built the state); None where the update could not run (on meta, Adafactor's update reads a value)."""
    if not optimizer.state:
        return None
    existing = {p.untyped_storage()._cdata for p in params}
    existing |= {p.grad.untyped_storage()._cdata for p in params}
    for state in optimizer.state.values():
        existing |= {v.untyped_storage()._cdata for v in state.values() if isinstance(v, torch.Tensor)}
    mode = _NewStorages(existing)
    try:
        with mode:
            optimizer.step()
    except (RuntimeError, NotImplementedError):
        return None
    return mode.peak


def _master_copies(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """fp32 copies of 16-bit weights with their gradients in fp32: what mixed-precision training steps."""
    copies = []
    for p in params:
        copy = torch.nn.Parameter(p.detach().float())
        copy.grad = p.grad.detach().float()
        copies.append(copy)
    return copies


def _step(optimizer: torch.optim.Optimizer, run: Run, notes: list[str]) -> bool:
    """One step: through the run's GradScaler when it has one (float16 autocast). True when the update ran."""
    scaler = run.scaler
    if run.real and scaler is not None:
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if optimizer.state:
            # the loss's scaling is the scaler's own note (capture.autocast.scaler_note): only the step's part here
            notes.append(f"GradScaler: the step divided the gradients by {scale:,.0f} again, found them finite and "
                         f"ran (next scale {scaler.get_scale():,.0f}).")
            return True
        notes.append(f"GradScaler: the gradients held inf/NaN (scaled by {scale:,.0f}), so the scaler "
                     f"skipped the step (next scale {scaler.get_scale():,.0f}) as training would; the state counted "
                     "is the one a plain step builds.")
        optimizer.step()
        return False
    if run.real:
        optimizer.step()
        return True
    try:
        optimizer.step()
        return True
    except (RuntimeError, NotImplementedError) as exc:  # a value read on meta (.item()) after the state was built
        notes.append(f"On meta the optimizer's update stopped where it reads a value ({str(exc).splitlines()[0]}); "
                     "its state had been built by torch.optim's own initialisation, with the shapes and dtypes a "
                     "real step gives.")
        return False
