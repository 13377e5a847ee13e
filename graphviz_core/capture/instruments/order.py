"""The order the autograd engine ran the nodes in (each node's `backward_index`)."""

from __future__ import annotations

from graphviz_core.capture.instrument import Instrument, Run


class BackwardOrder(Instrument):
    name = "order"

    def start(self, run: Run) -> None:
        super().start(run)
        self.order: list[str] = []
        self.position: dict[str, int] = {}

    def node_pre(self, node_id: str) -> None:
        self.order.append(node_id)

    def after_backward(self, run: Run) -> None:
        for index, node_id in enumerate(self.order):
            self.position.setdefault(node_id, index)

    def annotate(self, node_id: str, record: dict) -> None:
        record["backward_index"] = self.position.get(node_id)
