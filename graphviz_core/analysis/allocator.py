"""Replays an ordered trace of tensor allocations and frees through the rules of PyTorch's CUDA caching allocator and
reports what it would have reserved from the device: an estimate of `torch.cuda.max_memory_reserved()` for a step
whose allocations were recorded without a GPU (graphviz_core.parallel.allocation_trace).

The rules are those of `DeviceCachingAllocator` in PyTorch's c10/cuda/CUDACachingAllocator.cpp (read at
pytorch/pytorch commit 001074d25084), default settings
(no `max_split_size_mb`, no `roundup_power2_divisions`, no garbage-collection threshold, no CUDA graphs), function by
function:

- `round_size`: every request is rounded up to a multiple of 512 B (kMinBlockSize), at least 512 B.
- `get_pool`: requests of at most 1 MiB (kSmallSize) go to the small pool, larger ones to the large pool.
- `get_free_block`: best fit among the cached free blocks of the request's pool *and stream*: the set is ordered by
  `BlockComparatorSize` (stream, then size, then address) and searched with `lower_bound`, so the smallest free
  block at least as large, the lowest address among equals. A block freed on one stream is never handed to another.
- `get_allocation_size` / `alloc_block`: only when no cached block fits is a new segment taken from the device
  (`cudaMalloc`): 2 MiB (kSmallBuffer) for the small pool, 20 MiB (kLargeBuffer) for requests above 1 MiB and
  below 10 MiB (kMinLargeAlloc), otherwise the request rounded up to 2 MiB (kRoundLarge).
- `should_split` / `alloc_found_block`: a block larger than the request is split when the rest is at least 512 B
  (small pool) or more than 1 MiB (large pool); otherwise the whole block is handed out, and counted as allocated.
- `free_block` / `try_merge_blocks`: a freed block merges with its free neighbours of the same segment and goes
  back to the cache; the segment stays reserved (only `release_cached_blocks`, on an out-of-memory retry or
  `torch.cuda.empty_cache()`, gives memory back).

With `expandable_segments=True` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; Note [Expandable Segments] in
the same file) each (pool, stream) has one segment of virtual address space that grows by mapping pages of 2 MiB
(small pool) or 20 MiB (large pool):

- `alloc_block` calls `try_allocate_expandable_block`, which asks `find_expandable_block` for the lowest address
  with enough free or unmapped room (the free block just before the unmapped tail counts), then `map_block` maps
  just enough pages after it, merging with that free block.
- `should_split`: any block, small or large, is split when the rest is at least 512 B.
- `get_free_block`: among fitting blocks, one followed by unmapped space counts as its size plus that space, so a
  slightly larger block elsewhere is preferred to eating into the growing end.
- Reserved bytes are the mapped pages (`map_block` / `unmap_block` update `reserved_bytes`).

`capacity_bytes`, when given, is the device's memory: a mapping or `cudaMalloc` that would pass it first releases
the cached memory (`release_cached_blocks`: whole free segments, or for expandable segments the whole free pages
inside free blocks, `unmap_block`) and tries once more, as `malloc` does; a second failure raises MemoryError.

Not replayed: events and `record_stream` (a block used on another stream is returned only once that stream's work
is done; FSDP2 holds references instead), CUDA graphs' private pools, and memory outside this allocator (the CUDA
context, NCCL's buffers).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MIN_BLOCK = 512  # kMinBlockSize: every size is rounded up to a multiple of this
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request served by the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool segment (and expandable page)
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a segment for 1-10 MiB requests (and expandable large-pool page)
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here on a segment is the request rounded to 2 MiB
ROUND_LARGE = 2 << 20  # kRoundLarge
_VIRTUAL_SPACE = 1 << 48  # an expandable segment's address space: far more than any device's memory
_SEGMENT_GAP = 1 << 40  # distance between segments' made-up base addresses


def round_size(nbytes: int) -> int:
    """`round_size`: the request rounded up to a multiple of 512 B, at least 512 B."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else MIN_BLOCK * -(-nbytes // MIN_BLOCK)


def allocation_size(size: int) -> int:
    """`get_allocation_size`: the segment `cudaMalloc` is asked for when no cached block fits `size` (rounded)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


class _Block:
    """`Block`: a stretch of one segment, allocated or cached free, or (expandable segments) not yet mapped."""

    __slots__ = ("ptr", "size", "stream", "small", "allocated", "mapped", "prev", "next", "segment", "requested")

    def __init__(self, ptr: int, size: int, stream: str, small: bool, segment: int, mapped: bool = True) -> None:
        self.ptr, self.size, self.stream, self.small, self.segment = ptr, size, stream, small, segment
        self.allocated, self.mapped, self.requested = False, mapped, 0
        self.prev: _Block | None = None
        self.next: _Block | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.ptr)  # BlockComparatorSize within one (pool, stream)


@dataclass(frozen=True)
class ReplayResult:
    """What the allocator held over a replay: every figure in bytes, as torch.cuda.memory_stats() names them."""

    expandable_segments: bool
    peak_requested_bytes: int  # "requested_bytes.all.peak": the tensors' own bytes
    peak_allocated_bytes: int  # "allocated_bytes.all.peak": the blocks handed out (rounded, unsplit remainders)
    peak_reserved_bytes: int  # "reserved_bytes.all.peak": segments (mapped pages) held from the device
    reserved_at_allocated_peak_bytes: int  # reserved when allocated peaked
    segments: int  # segments at the end ("segment.all.current"; expandable: one per pool and stream)
    peak_segments: int
    device_allocations: int  # cudaMalloc calls, or page mappings with expandable segments ("num_device_alloc")
    retries: int  # out-of-memory retries after releasing the cache ("num_alloc_retries")
    peak_reserved_by_stream: dict[str, int] = field(default_factory=dict)


class CachingAllocator:
    """`DeviceCachingAllocator`'s malloc and free over made-up addresses; see the module docstring for the rules."""

    def __init__(self, expandable_segments: bool = False, capacity_bytes: int | None = None) -> None:
        self.expandable = expandable_segments
        self.capacity = capacity_bytes
        self._free: dict[tuple[bool, str], list[tuple[int, int, _Block]]] = {}  # (small, stream) -> sorted by key
        self._unmapped: dict[tuple[bool, str], list[tuple[int, _Block]]] = {}  # sorted by address
        self._live: dict[object, _Block] = {}
        self._segments = 0
        self._next_base = _SEGMENT_GAP
        self._segment_of_pool: dict[tuple[bool, str], int] = {}
        self.requested = self.allocated = self.reserved = 0
        self.reserved_by_stream: dict[str, int] = {}
        self.peak_requested = self.peak_allocated = self.peak_reserved = 0
        self.reserved_at_allocated_peak = 0
        self.peak_segments = self.device_allocations = self.retries = 0
        self.peak_reserved_by_stream: dict[str, int] = {}

    # ---- the public calls: malloc and free ----------------------------------------------------------------------

    def malloc(self, key: object, nbytes: int, stream: str = "default") -> None:
        """`malloc`: hand out a block for `nbytes` on `stream` (cached best fit, else a new segment)."""
        if key in self._live:
            raise ValueError(f"allocation {key!r} is already live; free it before allocating it again.")
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._get_free_block(small, stream, size)
        if block is None:
            block = self._alloc_block(small, stream, size)
            if block is None and self.capacity is not None:
                self.retries += 1
                self.release_cached_blocks()
                block = self._alloc_block(small, stream, size)
            if block is None:
                raise MemoryError(
                    f"out of memory: {size:,} B more on stream {stream!r} does not fit in {self.capacity:,} B "
                    f"({self.reserved:,} B reserved, {self.allocated:,} B allocated)."
                )
        if self._should_split(block, size):
            block = self._split(block, size)
        block.allocated, block.requested = True, nbytes
        self._live[key] = block
        self.requested += nbytes
        self.allocated += block.size
        self.peak_requested = max(self.peak_requested, self.requested)
        if self.allocated > self.peak_allocated:
            self.peak_allocated, self.reserved_at_allocated_peak = self.allocated, self.reserved

    def free(self, key: object) -> None:
        """`free` -> `free_block`: the block merges with free neighbours and is cached for its stream."""
        block = self._live.pop(key, None)
        if block is None:
            raise ValueError(f"allocation {key!r} is not live; it was never allocated or was freed already.")
        self.requested -= block.requested
        self.allocated -= block.size
        block.allocated, block.requested = False, 0
        for neighbour in (block.prev, block.next):
            self._try_merge(block, neighbour)
        self._insert_free(block)

    def result(self) -> ReplayResult:
        return ReplayResult(
            expandable_segments=self.expandable,
            peak_requested_bytes=self.peak_requested,
            peak_allocated_bytes=self.peak_allocated,
            peak_reserved_bytes=self.peak_reserved,
            reserved_at_allocated_peak_bytes=self.reserved_at_allocated_peak,
            segments=self._segments,
            peak_segments=self.peak_segments,
            device_allocations=self.device_allocations,
            retries=self.retries,
            peak_reserved_by_stream=dict(self.peak_reserved_by_stream),
        )

    # ---- pools ----------------------------------------------------------------------------------------------------

    def _insert_free(self, block: _Block) -> None:
        insort(self._free.setdefault((block.small, block.stream), []), (*block.key, block))

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[(block.small, block.stream)]
        del pool[bisect_left(pool, block.key, key=lambda entry: entry[:2])]

    def _insert_unmapped(self, block: _Block) -> None:
        insort(self._unmapped.setdefault((block.small, block.stream), []), (block.ptr, block))

    def _remove_unmapped(self, block: _Block) -> None:
        pool = self._unmapped[(block.small, block.stream)]
        del pool[bisect_left(pool, block.ptr, key=lambda entry: entry[0])]

    def _get_free_block(self, small: bool, stream: str, size: int) -> _Block | None:
        """`get_free_block`: `lower_bound` of (stream, size) in the pool's size-ordered set."""
        pool = self._free.get((small, stream), [])
        i = bisect_left(pool, size, key=lambda entry: entry[0])
        if i == len(pool):
            return None
        if self.expandable:
            # A block followed by unmapped space counts as its size plus that space (`expandable_size`): walk on
            # to larger blocks while the next one's expandable size is smaller.
            def expandable_size(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            while i + 1 < len(pool) and expandable_size(pool[i + 1][2]) < expandable_size(pool[i][2]):
                i += 1
        block = pool.pop(i)[2]
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        """`should_split`: small pool (or any pool with expandable segments) keeps a rest of >= 512 B; the large
        pool only a rest of more than 1 MiB."""
        remaining = block.size - size
        if block.small or self.expandable:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_SIZE

    def _split(self, block: _Block, size: int) -> _Block:
        """`alloc_found_block`: the front `size` bytes are handed out, the rest goes back to the pool."""
        front = _Block(block.ptr, size, block.stream, block.small, block.segment)
        front.prev, front.next = block.prev, block
        if block.prev is not None:
            block.prev.next = front
        block.prev = front
        block.ptr += size
        block.size -= size
        self._insert_free(block)
        return front

    def _try_merge(self, dst: _Block, src: _Block | None) -> None:
        """`try_merge_blocks`: absorb a free neighbour in the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove_free(src)
        else:
            self._remove_unmapped(src)
        if dst.prev is src:  # [src dst]
            dst.ptr, dst.prev = src.ptr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # ---- taking memory from the device ----------------------------------------------------------------------------

    def _reserve(self, stream: str, nbytes: int) -> bool:
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return False
        self.reserved += nbytes
        self.reserved_by_stream[stream] = self.reserved_by_stream.get(stream, 0) + nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        peak = self.peak_reserved_by_stream
        peak[stream] = max(peak.get(stream, 0), self.reserved_by_stream[stream])
        self.device_allocations += 1
        return True

    def _unreserve(self, stream: str, nbytes: int) -> None:
        self.reserved -= nbytes
        self.reserved_by_stream[stream] -= nbytes

    def _new_segment(self) -> tuple[int, int]:
        base, self._next_base = self._next_base, self._next_base + _SEGMENT_GAP
        self._segments += 1
        self.peak_segments = max(self.peak_segments, self._segments)
        return base, self._segments

    def _alloc_block(self, small: bool, stream: str, size: int) -> _Block | None:
        """`alloc_block`: a new segment of `get_allocation_size` bytes, or `try_allocate_expandable_block`."""
        if self.expandable:
            return self._try_allocate_expandable_block(small, stream, size)
        nbytes = allocation_size(size)
        if not self._reserve(stream, nbytes):
            return None
        base, segment = self._new_segment()
        return _Block(base, nbytes, stream, small, segment)

    def _try_allocate_expandable_block(self, small: bool, stream: str, size: int) -> _Block | None:
        """`try_allocate_expandable_block`: map pages after the lowest free room until one block holds `size`."""
        candidate = self._find_expandable_block(small, stream, size)
        if not candidate.mapped:
            candidate = self._map_block(candidate, min(candidate.size, size))
            if candidate is None:
                return None
        while candidate.size < size:
            # free -> unmapped -> ...: map the next stretch; map_block merges it with `candidate`
            candidate = self._map_block(candidate.next, min(size - candidate.size, candidate.next.size))
            if candidate is None:
                return None
        self._remove_free(candidate)
        return candidate

    def _find_expandable_block(self, small: bool, stream: str, size: int) -> _Block:
        """`find_expandable_block`: the lowest address of an unmapped stretch (or the free block just before it)
        from which free and unmapped blocks add up to `size`; a new segment when there is none."""

        def room_from(b: _Block | None) -> bool:
            total = 0
            while total < size and b is not None and not b.allocated:
                total, b = total + b.size, b.next
            return total >= size

        for _, unmapped in list(self._unmapped.get((small, stream), [])):
            c = unmapped.prev if unmapped.prev is not None and not unmapped.prev.allocated else unmapped
            if room_from(c):
                return c
        base, segment = self._new_segment()
        self._segment_of_pool[(small, stream)] = segment
        block = _Block(base, _VIRTUAL_SPACE, stream, small, segment, mapped=False)
        self._insert_unmapped(block)
        return block

    def _map_block(self, to_map: _Block, size: int) -> _Block | None:
        """`map_block` (`ExpandableSegment::map`): back [ptr, ptr + size) with whole pages; the rest stays unmapped;
        the mapped block merges with free neighbours."""
        page = SMALL_BUFFER if to_map.small else LARGE_BUFFER
        mapped = page * -(-size // page)
        mapped = min(mapped, to_map.size)
        if not self._reserve(to_map.stream, mapped):
            return None
        self._remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(
                to_map.ptr + mapped, to_map.size - mapped, to_map.stream, to_map.small, to_map.segment, mapped=False
            )
            rest.prev, rest.next = to_map, to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            to_map.size = mapped
            self._insert_unmapped(rest)
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        self._insert_free(to_map)
        return to_map

    # ---- giving memory back ---------------------------------------------------------------------------------------

    def release_cached_blocks(self) -> None:
        """`release_cached_blocks` -> `release_blocks`: free every whole cached segment (`release_block`), or with
        expandable segments unmap the whole pages inside every free block (`unmap_block`)."""
        for pool_key in sorted(self._free, key=lambda k: (k[0], k[1])):  # large pool first, as release_cached_blocks
            for _, _, block in list(self._free[pool_key]):
                if self.expandable:
                    self._unmap_block(block)
                elif block.prev is None and block.next is None:
                    self._remove_free(block)
                    self._unreserve(block.stream, block.size)
                    self._segments -= 1

    def _unmap_block(self, block: _Block) -> None:
        """`unmap_block` (`ExpandableSegment::unmap`): the whole pages inside a free block go back to the device."""
        page = SMALL_BUFFER if block.small else LARGE_BUFFER
        base = self._segment_base(block)
        begin = base + page * -(-(block.ptr - base) // page)
        end = base + page * ((block.ptr + block.size - base) // page)
        if begin >= end:
            return
        self._remove_free(block)
        if begin > block.ptr:
            before = _Block(block.ptr, begin - block.ptr, block.stream, block.small, block.segment)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            self._insert_free(before)
        if end < block.ptr + block.size:
            after = _Block(end, block.ptr + block.size - end, block.stream, block.small, block.segment)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            self._insert_free(after)
        block.ptr, block.size, block.mapped = begin, end - begin, False
        self._unreserve(block.stream, end - begin)
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        if block.prev is None and block.next is None:  # `release_expandable_segment`: nothing mapped is left
            self._segments -= 1
            return
        self._insert_unmapped(block)

    def _segment_base(self, block: _Block) -> int:
        first = block
        while first.prev is not None:
            first = first.prev
        return first.ptr


# ---- traces ---------------------------------------------------------------------------------------------------------

Event = tuple  # ("alloc", key, nbytes, stream) or ("free", key)


@dataclass(frozen=True)
class Trace:
    """One step's storages in order: `events[:step_start]` allocate what exists before the step (parameters,
    optimizer state, inputs); `events[step_start:]` are the step's own allocations and frees."""

    events: tuple[Event, ...]
    step_start: int = 0
    streams: dict[str, str] = field(default_factory=dict)  # stream label -> what allocates on it
    groups: dict[str, tuple] = field(default_factory=dict)  # kind ("optimizer state", ...) -> keys before the step
    marks: dict[str, int] = field(default_factory=dict)  # a point in the step ("optimizer") -> index in `events`
    persistent: tuple = ()  # keys the first step allocates and keeps: not allocated again when it is repeated

    def peak_bytes(self) -> int:
        """The running maximum of live bytes, counted from the trace alone (no allocator)."""
        live, peak, sizes = 0, 0, {}
        for event in self.events:
            if event[0] == "alloc":
                sizes[event[1]] = event[2]
                live += event[2]
                peak = max(peak, live)
            else:
                live -= sizes.pop(event[1])
        return peak

    def deferred(self, group: str, mark: str) -> Trace:
        """The same trace with one kind of storage from before the step allocated at `mark` of the step instead,
        and kept: torch.optim creates its state in the first `optimizer.step()`, amid the cache that the first
        forward and backward left."""
        keys, at = set(self.groups[group]), self.marks[mark]
        head = [e for e in self.events[: self.step_start] if e[1] not in keys]
        moved = [e for e in self.events[: self.step_start] if e[1] in keys]
        body = list(self.events[self.step_start :])
        split = at - self.step_start
        events = (*head, *body[:split], *moved, *body[split:])
        groups = {name: tuple(k for k in group_keys if k not in keys) for name, group_keys in self.groups.items()}
        return Trace(events, len(head), dict(self.streams), groups, {}, (*self.persistent, *sorted(keys)))

    def repeated(self, steps: int) -> Trace:
        """The same step run `steps` times, the cache one step leaves being where the next starts, as on a GPU.
        Before each repeat, what the previous step left allocated is freed (its gradients, as
        `zero_grad(set_to_none=True)` frees them; not the `persistent` keys); storages from before the step that
        the step freed (a batch's inputs) are allocated again, as the next batch's; then the step's events run
        again under new keys."""
        head, body = self.events[: self.step_start], self.events[self.step_start :]
        persistent = set(self.persistent)
        sizes = {e[1]: e[2:] for e in head if e[0] == "alloc"}
        own = set(_alloc_keys(body)) - persistent
        reborn = [e[1] for e in body if e[0] == "free" and e[1] not in own and e[1] not in persistent]
        later = [e for e in body if e[1] not in persistent]
        events: list[Event] = list(head)
        previous: list[Event] = []
        for step in range(steps):
            if step:
                events.extend(("free", key) for key in _live_keys(previous) if key not in persistent)
                events.extend(("alloc", (step, key), *sizes[key]) for key in reborn)
            previous = _renamed(body if step == 0 else later, step, own if step == 0 else own | set(reborn))
            events.extend(previous)
        return Trace(tuple(events), self.step_start, dict(self.streams))


def _alloc_keys(events: Iterable[Event]) -> list:
    return [event[1] for event in events if event[0] == "alloc"]


def _live_keys(events: Sequence[Event]) -> list:
    """Keys allocated in `events` and still live at their end."""
    live: dict = {}
    for event in events:
        if event[0] == "alloc":
            live[event[1]] = True
        else:
            live.pop(event[1], None)
    return list(live)


def _renamed(events: Sequence[Event], step: int, own: set) -> list[Event]:
    """The step's events with the keys in `own` (its own allocations) renamed (step, key)."""
    return [(e[0], (step, e[1]), *e[2:]) if e[1] in own else e for e in events]


def replay(
    trace: Trace | Sequence[Event], expandable_segments: bool = False, capacity_bytes: int | None = None
) -> ReplayResult:
    """Run every event of `trace` through a fresh CachingAllocator. Raises ValueError if the replay's requested
    peak differs from the trace's own running maximum (a free of an unknown key, or a bookkeeping slip)."""
    if not isinstance(trace, Trace):
        trace = Trace(tuple(trace))
    allocator = CachingAllocator(expandable_segments, capacity_bytes)
    for event in trace.events:
        if event[0] == "alloc":
            allocator.malloc(event[1], event[2], event[3] if len(event) > 3 else "default")
        elif event[0] == "free":
            allocator.free(event[1])
        else:
            raise ValueError(f"unknown event {event[0]!r}: a trace holds 'alloc' and 'free' events.")
    result = allocator.result()
    if result.peak_requested_bytes != trace.peak_bytes():
        raise ValueError(
            f"the replay's peak of requested bytes ({result.peak_requested_bytes:,}) differs from the trace's "
            f"own ({trace.peak_bytes():,})."
        )
    return result
