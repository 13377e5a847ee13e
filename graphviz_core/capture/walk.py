"""Walking the autograd graph: every node reachable from the loss in a deterministic order, and the small facts about
tensors and nodes the instruments share (storage keys, saved-tensor fields, autograd's sequence numbers)."""

from __future__ import annotations

import torch

next_sequence_nr = torch._C._autograd._get_sequence_nr  # the number autograd gives the next node this thread makes


def autograd_nodes(*roots) -> list:
    """Every node reachable from the roots (None ones skipped), in deterministic pre-order (next_functions order)."""
    order, seen, stack = [], set(), [r for r in reversed(roots) if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(reversed([n for n, _ in node.next_functions if n is not None]))
    return order


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(the storage's identity while it lives, its size in bytes)."""
    storage = t.untyped_storage()
    return storage._cdata, storage.nbytes()


_SAVED_FIELDS: dict[type, tuple[str, ...]] = {}


def saved_fields(node: object) -> tuple[str, ...]:
    """The attributes of `node` that hold tensors saved for its backward (`_saved_self`, ... or `saved_tensors`)."""
    kind = type(node)
    if kind not in _SAVED_FIELDS:
        names = tuple(n for n in dir(node) if n.startswith("_saved_"))
        if hasattr(node, "saved_tensors"):  # custom autograd.Function nodes
            names += ("saved_tensors",)
        _SAVED_FIELDS[kind] = names
    return _SAVED_FIELDS[kind]
