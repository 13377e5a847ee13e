"""The results every session of one server shares, the most recently used kept: one small thread-safe store for what a
page computes quickly from results it already has (the compare page's comparison of two cached captures). Anything that
runs long (captures, parallel simulations, plans, will-it-fit) goes through graphviz_core.serve.shared_captures, which
also queues, limits and cancels it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

Value = TypeVar("Value")


class Recent(Generic[Value]):
    """At most `size` results by key; reading one makes it the most recent, adding past `size` drops the oldest."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a store keeps at least one result, got {size}.")
        self.size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[Hashable, Value] = OrderedDict()

    def get(self, key: Hashable) -> Value | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def put(self, key: Hashable, value: Value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
