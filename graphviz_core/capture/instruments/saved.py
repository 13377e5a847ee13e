"""Saved tensors: every tensor autograd keeps for backward, which node keeps it, and its bytes (storages counted once,
parameters excluded); and the inputs checkpointed regions hold to re-run their forward."""

from __future__ import annotations

import weakref
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass

import networkx as nx
import torch

from graphviz_core.capture.instrument import Instrument, Run
from graphviz_core.capture.result import SaveEvent
from graphviz_core.capture.timeline import tensors_in
from graphviz_core.capture.walk import saved_fields, storage_key
from graphviz_core.models.checkpoint_policies import KEPT_BYTES, RECOMPUTED


class _Packed:
    """What the saved-tensor pack hook hands autograd: the tensor (autograd frees it as usual) and an id."""

    __slots__ = ("index", "tensor", "__weakref__")

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self.index = index
        self.tensor = tensor


@dataclass
class _Save:
    shape: tuple[int, ...]
    dtype: str
    storage_key: int
    storage_bytes: int
    is_parameter: bool


class SavedTensors(Instrument):
    """Saved-tensor hooks record every save in forward order; the graph walk reads each node's `_saved_*` fields,
    which calls the unpack hook with the save's id, so each save finds its node."""

    name = "saved"

    def start(self, run: Run) -> None:
        super().start(run)
        self.saves: list[_Save] = []
        self.packed: list[weakref.ref] = []  # what autograd still holds, emptied by release()
        self.checkpoint_held: dict[int, int] = {}  # storage key -> bytes of inputs checkpointed regions keep
        self.collecting: list[int] | None = None
        self.counted_bytes: Counter[str] = Counter()
        self.saved_of: dict[str, list[dict]] = {}
        self.save_events: tuple[SaveEvent, ...] = ()
        self.saved_keys: set[int] = set()  # storages saved for backward (not parameters): the timeline's kinds
        self.first_save: dict[int, int] = {}
        self.by_category: dict[str, int] = {}

    def forward_contexts(self, run: Run) -> list[AbstractContextManager]:
        return [torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)]

    def pack(self, tensor: torch.Tensor) -> _Packed:
        key, nbytes = storage_key(tensor)
        self.saves.append(
            _Save(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), key, nbytes, key in self.run.param_storages)
        )
        packed = _Packed(len(self.saves) - 1, tensor)
        self.packed.append(weakref.ref(packed))
        return packed

    def unpack(self, packed: _Packed) -> torch.Tensor:
        if self.collecting is not None:
            self.collecting.append(packed.index)
        return packed.tensor

    def module_pre(self, module, path: str, args: tuple, kwargs: dict) -> None:
        if self.run.phase == "forward" and getattr(module, RECOMPUTED, False):
            for t in tensors_in((args, kwargs)):
                key, nbytes = storage_key(t)
                if key not in self.run.param_storages:
                    self.checkpoint_held[key] = nbytes

    def after_forward(self, run: Run) -> None:
        saves_of = self._collect(run)
        saves = self.saves
        owner: dict[int, str] = {}  # storage key -> node id that the storage's bytes are charged to
        first_save = self.first_save
        for node_id, indices in saves_of.items():
            for index in indices:
                key = saves[index].storage_key
                if not saves[index].is_parameter and (key not in first_save or index < first_save[key]):
                    first_save[key] = index
                    owner[key] = node_id
        node_of_save = {index: node_id for node_id, indices in saves_of.items() for index in indices}
        events = []
        for index, save in enumerate(saves):
            if index not in node_of_save:
                continue  # saved for a node that backward never reaches from the loss
            counted = not save.is_parameter and first_save.get(save.storage_key) == index
            events.append(SaveEvent(index, node_of_save[index], save.shape, save.dtype, save.storage_bytes, counted))
            if counted:
                self.counted_bytes[node_of_save[index]] += save.storage_bytes
        self.save_events = tuple(events)
        for node_id, indices in saves_of.items():
            self.saved_of[node_id] = [
                {"shape": list(saves[i].shape), "dtype": saves[i].dtype, "bytes": saves[i].storage_bytes,
                 "counted": owner.get(saves[i].storage_key) == node_id and first_save.get(saves[i].storage_key) == i,
                 "parameter": saves[i].is_parameter}
                for i in indices
            ]
        self.saved_keys = {saves[i].storage_key for found in saves_of.values() for i in found
                           if not saves[i].is_parameter}

    def _collect(self, run: Run) -> dict[str, list[int]]:
        """Node id -> indices (into self.saves) of the tensors saved for that node's backward."""
        recomputed = run.modules.recomputed_nodes
        saves_of: dict[str, list[int]] = {}
        for node in run.nodes:
            found: list[int] = []
            if node in recomputed:
                # Reading these fields would run checkpoint's unpack hook, i.e. the recomputation.
                saves_of[run.ids[node]] = found
                continue
            self.collecting = found
            for name in saved_fields(node):
                try:
                    getattr(node, name)
                except RuntimeError:  # a field that is freed or undefined for this node
                    continue
            self.collecting = None
            saves_of[run.ids[node]] = sorted(set(found))
        return saves_of

    def annotate(self, node_id: str, record: dict) -> None:
        record["saved_bytes"] = self.counted_bytes[node_id]
        record["saved"] = self.saved_of[node_id]

    def finish(self, run: Run, graph: nx.DiGraph) -> None:
        by_category: Counter[str] = Counter()
        for node_id, data in graph.nodes(data=True):
            by_category[data["category"]] += self.counted_bytes[node_id]
        self.by_category = {k: v for k, v in sorted(by_category.items()) if v}

    @property
    def saved_bytes(self) -> int:
        return sum(self.counted_bytes.values())

    @property
    def checkpoint_held_bytes(self) -> int:
        """Inputs checkpointed regions keep (not also saved tensors), plus the outputs a selective-checkpoint policy
        kept (graphviz_core.models.hf): stored by the checkpoint itself, where no hook sees them."""
        held = sum(b for key, b in self.checkpoint_held.items() if key not in self.first_save)
        return held + getattr(self.run.model, KEPT_BYTES, 0)

    def release(self) -> None:
        """Also empty every save autograd still holds. A saved output holds its own grad_fn, which holds the save: a
        cycle through C++ that no collector sees. A backward that ran frees it; one stopped before its end (Cancel,
        the run time limit) would keep the whole graph's tensors for the life of the process."""
        self.saved_of.clear()
        for ref in self.packed:
            packed = ref()
            if packed is not None:
                packed.tensor = None
        self.packed = []
