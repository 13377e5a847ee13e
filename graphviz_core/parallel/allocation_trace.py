"""Records the order in which a step allocates and frees tensor storages, with the stream each was allocated on, for
graphviz_core.analysis.allocator to replay through the CUDA caching allocator's rules.

A TorchDispatchMode sees every op's outputs: a storage it has not seen is an allocation (its bytes,
`untyped_storage().nbytes()`) and a weak reference on it reports the free when the last tensor using it dies — the
way torch's MemTracker counts, but kept apart from it, so the two can check each other. `UntypedStorage.resize_`
does not pass through dispatch (FSDP2 allocates and frees its gathered parameters that way), so it is wrapped while
recording: growing from 0 bytes is an allocation, shrinking to 0 a free, any other change an allocation of the new
size followed by the free of the old (a copy). Storages that exist when recording starts (parameters, optimizer
state, the batch; not module buffers, which no peak here counts) are listed first, as allocations before the step.

Streams: FSDP2 allocates on the stream current when the op runs (`device_handle.stream(...)` in
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): the all-gather buffer on its all-gather copy-in stream,
the reduce-scatter output on its reduce-scatter stream. On CPU, FSDP2's streams are `torch.cpu.Stream` objects and
`torch.cpu.current_stream()` says which one is current, so each allocation is labelled by the stream current at the
time, named after the FSDP communication context's attribute that holds it.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphviz_core.analysis.allocator import Trace
from graphviz_core.capture.meta_kernels import cuda_temporary_bytes

DEFAULT_STREAM = "default"
_FSDP_STREAMS = ("all_gather_copy_in_stream", "all_gather_stream", "reduce_scatter_stream", "all_reduce_stream")


def _storages(value: Any, device_type: str | None = None) -> list[torch.UntypedStorage]:
    """The untyped storages of the plain tensors in `value` (a DTensor's local shard; a fake tensor's own), only
    those on devices of `device_type` if given."""
    out = []
    for leaf in tree_leaves(value):
        if not isinstance(leaf, torch.Tensor):
            continue
        local = getattr(leaf, "_local_tensor", leaf)  # DTensor -> its shard on this rank
        if device_type is not None and local.device.type != device_type:
            continue
        try:
            out.append(local.untyped_storage())
        except (RuntimeError, NotImplementedError):  # sparse or other storage-less tensors hold no bytes of their own
            continue
    return out


def step_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *batch: Any) -> dict[str, list]:
    """What exists before a training step, by kind: parameters (a DTensor's local shard), optimizer state, the batch.
    Module buffers are left out, as every peak here leaves them out (they are reported on their own)."""
    state = list(optimizer.state.values()) if optimizer is not None else []
    return {
        "parameters": list(model.parameters()),
        "optimizer state": tree_leaves(state),
        "batch": tree_leaves(list(batch)),
    }


class NotRecording(contextlib.nullcontext):
    """Stands in for AllocationRecorder when no trace was asked for: nothing is wrapped, nothing recorded."""

    def mark(self, name: str) -> None:
        pass

    def deliver(self, model: torch.nn.Module, callback) -> None:
        pass


class AllocationRecorder(TorchDispatchMode):
    """Context manager that records allocations and frees of tensor storages as `trace()` events (see module)."""

    def __init__(
        self, existing: Any = (), stream_names: dict[int, str] | None = None, device_type: str | None = None
    ) -> None:
        """`existing`: tensors alive before the step (a dict of them by kind keeps the kinds apart in the trace's
        `groups`); `device_type`: record only storages on that kind of device (a real CUDA step also makes CPU
        tensors, AdamW's step counts)."""
        super().__init__()
        self._existing = existing if isinstance(existing, dict) else {"before the step": existing}
        self._groups: dict[str, tuple] = {}
        self._marks: dict[str, int] = {}
        self._device_type = device_type
        self._events: list[tuple] = []
        self._key_of: dict[int, int] = {}  # id(storage) -> key of its current allocation
        self._refs: dict[int, weakref.ref] = {}
        self._next_key = 0
        self._step_start = 0
        self._streams: dict[int, torch.cpu.Stream] = {}  # label index -> stream object (kept to name it later)
        self._stream_labels: dict[int, str] = {}  # id(stream) -> label
        self._default = None
        self._fake_mode = None
        self._orig_resize = None
        self.stream_names = dict(stream_names or {})

    # ---- entering and leaving ---------------------------------------------------------------------------------

    def __enter__(self) -> AllocationRecorder:
        from torch._guards import active_fake_mode

        self._fake_mode = active_fake_mode()
        self._default = torch.cpu.current_stream()
        for group, tensors in self._existing.items():
            first = self._next_key
            for storage in _storages(tensors, self._device_type):
                if id(storage) not in self._key_of:  # tied weights: one storage
                    self._allocate(storage)
            self._groups[group] = tuple(range(first, self._next_key))
        self._step_start = len(self._events)
        self._orig_resize = torch.UntypedStorage.resize_
        recorder, original = self, self._orig_resize

        def resize_(storage: torch.UntypedStorage, size: int):
            before = storage.nbytes()
            out = original(storage, size)
            recorder._resized(storage, before)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._guards import active_fake_mode
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        # A simulated GPU kernel's own workspace (meta_kernels.cuda_temporary_bytes): allocated as it starts, freed
        # once its output exists. A real step's kernels allocate theirs through the allocator, unseen here.
        held = cuda_temporary_bytes(func, args) if self._fake_mode is not None else 0
        if held:
            workspace, self._next_key = self._next_key, self._next_key + 1
            self._events.append(("alloc", workspace, held, self._stream()))
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return out  # waits on its input in place; a fake kernel may hand back a new tensor (see MemTracker)
        if active_fake_mode() is self._fake_mode:  # not DTensor's nested fake mode working out global shapes
            for storage in _storages(out, self._device_type):
                if id(storage) not in self._key_of:
                    self._allocate(storage)
        if held:
            self._events.append(("free", workspace))
        return out

    # ---- events -----------------------------------------------------------------------------------------------

    def _stream(self) -> str:
        stream = torch.cpu.current_stream()
        if stream is self._default:
            return DEFAULT_STREAM
        label = self._stream_labels.get(id(stream))
        if label is None:
            label = f"stream {len(self._streams) + 1}"
            self._streams[len(self._streams)] = stream
            self._stream_labels[id(stream)] = label
        return label

    def _allocate(self, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        key, self._next_key = self._next_key, self._next_key + 1
        self._events.append(("alloc", key, nbytes, self._stream()))
        ident = id(storage)
        self._key_of[ident] = key
        if ident not in self._refs:
            self._refs[ident] = weakref.ref(storage, lambda _ref, ident=ident: self._died(ident))

    def _free(self, ident: int) -> None:
        key = self._key_of.pop(ident, None)
        if key is not None:
            self._events.append(("free", key))

    def _died(self, ident: int) -> None:
        self._refs.pop(ident, None)
        self._free(ident)

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        ident = id(storage)
        if ident not in self._key_of and before > 0:
            return  # a storage never seen at its old size: not ours to count
        old = self._key_of.pop(ident, None)
        if storage.nbytes() > 0:
            self._allocate(storage)
        if old is not None:
            self._events.append(("free", old))

    def mark(self, name: str) -> None:
        """Remember where the step is (the trace's `marks`: name -> index of the next event)."""
        self._marks[name] = len(self._events)

    # ---- the result -------------------------------------------------------------------------------------------

    def trace(self) -> Trace:
        """The events so far, with each extra stream named after the FSDP2 stream it is (when `stream_names`
        or `name_streams` say so)."""
        names = {DEFAULT_STREAM: "the default (compute) stream"}
        for stream in self._streams.values():
            label = self._stream_labels[id(stream)]
            names[label] = self.stream_names.get(id(stream), label)
        return Trace(tuple(self._events), self._step_start, names, dict(self._groups), dict(self._marks))

    def deliver(self, model: torch.nn.Module, callback) -> None:
        """Hand the trace so far, its streams named after `model`'s FSDP2 streams, to `callback`."""
        self.name_streams(model)
        callback(self.trace())

    def name_streams(self, model: torch.nn.Module) -> None:
        """Name the streams of FSDP2's communication context in `model` (created lazily by its first forward)."""
        for module in model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            context = getattr(state(), "_comm_ctx", None) if state is not None else None
            if context is None:
                continue
            for attribute in _FSDP_STREAMS:
                stream = getattr(context, attribute, None)
                if stream is not None:
                    self.stream_names[id(stream)] = f"FSDP2 {attribute.replace('_', ' ')}"
            return
