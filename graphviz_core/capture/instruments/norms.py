"""Gradient norms: the L2 norm of the gradient flowing out of each node (none on meta)."""

from __future__ import annotations

import math
import weakref

import torch

from graphviz_core.capture.instrument import Instrument, Run


class GradientNorms(Instrument):
    name = "norms"

    def start(self, run: Run) -> None:
        super().start(run)
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.seen: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(gradient) -> (ref, its norm)
        self.values: dict[int, float] = {}

    def node_post(self, node_id: str, is_leaf: bool, grad_inputs: tuple, grad_outputs: tuple) -> None:
        if not self.run.real:
            return
        # Bookkeeping, not the model's work: the capture's own dispatch mode (FLOPs, timeline) never sees it.
        with torch._C._DisableTorchDispatch():
            self.parts[node_id] = [self._norm_once(g) for g in (grad_outputs if is_leaf else grad_inputs)
                                   if g is not None]

    def _norm_once(self, g: torch.Tensor) -> torch.Tensor:
        """The L2 norm of one gradient, read once however many nodes it passes through: a parameter's gradient
        is sent by one node and received by its AccumulateGrad, an add sends the same tensor down both paths.
        Keyed by the Python object (PyTorch keeps one per live tensor), checked with a weak reference so a
        recycled id never returns another tensor's norm."""
        seen = self.seen.get(id(g))
        if seen is not None and seen[0]() is g:
            return seen[1]
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        self.seen[id(g)] = (weakref.ref(g), norm)
        return norm

    def after_backward(self, run: Run) -> None:
        """Every norm read in one transfer (one sync on CUDA, instead of one per gradient). Under float16 autocast the
        backward carried the GradScaler's scaled gradients: the norms are divided by its scale, so they read as the
        gradients the optimizer steps with (after the scaler unscales them)."""
        unique = {id(p): p for parts in self.parts.values() for p in parts}
        scale = run.scaler.get_scale() if run.scaler is not None and run.real else 1.0
        if unique:
            norms = torch.stack(list(unique.values())).tolist()
            self.values = dict(zip(unique, (norm / scale for norm in norms), strict=True))

    def annotate(self, node_id: str, record: dict) -> None:
        parts = self.parts.get(node_id)
        if parts:
            record["grad_norm"] = math.sqrt(sum(self.values[id(p)] ** 2 for p in parts))

    def release(self) -> None:
        self.parts.clear()
        self.seen.clear()
