"""Node timing: the wall time of each node's backward (perf counter on CPU, CUDA events on a GPU); none on meta."""

from __future__ import annotations

import time

import torch

from graphviz_core.capture.instrument import Instrument, Run


class NodeTiming(Instrument):
    name = "timing"

    def start(self, run: Run) -> None:
        super().start(run)
        self.started: dict[str, object] = {}
        self.ended: dict[str, object] = {}
        self.cuda = run.device == "cuda"

    def _clock(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def node_pre(self, node_id: str) -> None:
        self.started[node_id] = self._clock()  # last of the pre hooks: the clock starts as the node does

    def node_post(self, node_id: str, is_leaf: bool, grad_inputs: tuple, grad_outputs: tuple) -> None:
        self.ended[node_id] = self._clock()  # first of the post hooks

    def annotate(self, node_id: str, record: dict) -> None:
        if not self.run.real or node_id not in self.ended:
            return
        start, end = self.started[node_id], self.ended[node_id]
        record["time_s"] = start.elapsed_time(end) / 1000.0 if self.cuda else end - start

    def release(self) -> None:
        self.started.clear()
        self.ended.clear()
