"""The caching-allocator replay (graphviz_core.analysis.allocator) against sequences worked out by hand from the rules
of c10/cuda/CUDACachingAllocator.cpp, function by function (the module docstring lists them)."""

from __future__ import annotations

import random

import pytest

from graphviz_core.analysis.allocator import CachingAllocator, Trace, allocation_size, replay, round_size

MIB = 2**20


def test_round_size_and_segment_sizes_follow_the_constants():
    assert round_size(1) == 512  # below kMinBlockSize: 512
    assert round_size(513) == 1024  # up to the next multiple of 512
    assert allocation_size(512) == 2 * MIB  # small pool (<= 1 MiB): a 2 MiB segment
    assert allocation_size(MIB) == 2 * MIB  # 1 MiB is still small
    assert allocation_size(MIB + 512) == 20 * MIB  # above 1 MiB, below 10 MiB: kLargeBuffer
    assert allocation_size(10 * MIB) == 10 * MIB  # from kMinLargeAlloc on: rounded to 2 MiB, already a multiple
    assert allocation_size(10 * MIB + 512) == 12 * MIB  # 10 MiB + 512 B rounded up to 2 MiB


def test_a_large_request_splits_a_20_mib_segment_and_the_rest_serves_the_next():
    a = CachingAllocator()
    a.malloc("a", 3 * MIB)  # 1 MiB < 3 MiB < 10 MiB: a 20 MiB segment; rest 17 MiB > 1 MiB: split
    assert (a.reserved, a.allocated) == (20 * MIB, 3 * MIB)
    a.malloc("b", 5 * MIB)  # best fit: the 17 MiB rest, split again (12 MiB left); no new segment
    assert (a.reserved, a.allocated) == (20 * MIB, 8 * MIB)
    a.malloc("c", 100)  # small pool: 512 B in a new 2 MiB segment
    assert (a.reserved, a.allocated, a.requested) == (22 * MIB, 8 * MIB + 512, 8 * MIB + 100)
    assert a.result().segments == 2


def test_the_large_pool_does_not_split_off_a_rest_of_1_mib_or_less():
    a = CachingAllocator()
    a.malloc("a", 19 * MIB + MIB // 2)  # >= 10 MiB: segment rounded to 2 MiB = 20 MiB; rest 0.5 MiB: not split
    assert (a.reserved, a.allocated, a.requested) == (20 * MIB, 20 * MIB, 19 * MIB + MIB // 2)
    b = CachingAllocator()
    b.malloc("a", 10 * MIB + 1)  # 10 MiB + 512 B in a 12 MiB segment; rest 2 MiB - 512 B > 1 MiB: split
    assert (b.reserved, b.allocated) == (12 * MIB, 10 * MIB + 512)


def test_blocks_are_reused_only_on_the_stream_that_allocated_them():
    a = CachingAllocator()
    a.malloc("x", 3 * MIB, "s1")
    a.free("x")  # cached for s1: 20 MiB reserved, nothing allocated
    a.malloc("y", 3 * MIB, "s2")  # s1's free block is not s2's: a second 20 MiB segment
    assert a.reserved == 40 * MIB
    a.free("y")
    a.malloc("z", 3 * MIB, "s1")  # s1's cached block again: no third segment
    assert a.reserved == 40 * MIB and a.result().peak_reserved_by_stream == {"s1": 20 * MIB, "s2": 20 * MIB}


def test_freed_neighbours_merge_into_one_block_that_fits_a_bigger_request():
    a = CachingAllocator()
    a.malloc("a", 3 * MIB)  # [a 3][free 17] in one 20 MiB segment
    a.malloc("b", 3 * MIB)  # [a 3][b 3][free 14]
    a.free("a")  # [free 3][b 3][free 14]: a cannot merge with b
    a.free("b")  # b merges with both neighbours: [free 20]
    a.malloc("c", 18 * MIB)  # fits the merged 20 MiB block: no new segment (unmerged, the largest was 14 MiB)
    assert (a.reserved, a.allocated) == (20 * MIB, 18 * MIB)  # the 2 MiB rest is > 1 MiB: split off, not handed out


def test_best_fit_takes_the_smallest_block_that_fits_lowest_address_first():
    a = CachingAllocator()
    # One 20 MiB segment (the first request, 6 MiB, is below 10 MiB): [A 6][B 2][C 5][D 2][free 5]
    for key, size in (("A", 6), ("B", 2), ("C", 5), ("D", 2)):
        a.malloc(key, size * MIB)
    a.free("A")
    a.free("C")  # free blocks: 6 MiB at 0, 5 MiB at 8, 5 MiB at 15
    a.malloc("p", 5 * MIB)  # best fit: a 5 MiB block, the lower address (C's)
    a.malloc("q", 6 * MIB)  # A's 6 MiB block
    a.malloc("r", 5 * MIB)  # the 5 MiB at the end
    # First fit by address would have put p in A's 6 MiB block and sent q to a new segment.
    assert (a.reserved, a.allocated) == (20 * MIB, 20 * MIB)  # B 2 + D 2 + p 5 + q 6 + r 5 = 20 MiB
    assert a.result().peak_segments == 1


def test_expandable_segments_map_20_mib_pages_and_grow_at_the_end():
    a = CachingAllocator(expandable_segments=True)
    a.malloc("a", 30 * MIB)  # large pool: ceil(30 / 20) = 2 pages mapped = 40 MiB; rest 10 MiB split off
    assert (a.reserved, a.allocated) == (40 * MIB, 30 * MIB)
    a.malloc("b", 5 * MIB)  # fits the 10 MiB rest at 30: [a 30][b 5][free 5 | unmapped]
    assert a.reserved == 40 * MIB
    a.free("a")  # [free 30][b 5][free 5 | unmapped]
    # 50 MiB fits no free block; the lowest room is the free 5 MiB before the unmapped end: map 45 MiB more,
    # ceil(45 / 20) = 3 pages = 60 MiB -> 100 MiB reserved
    a.malloc("c", 50 * MIB)
    assert (a.reserved, a.allocated) == (100 * MIB, 55 * MIB)
    a.malloc("d", 100)  # the small pool has its own segment of 2 MiB pages
    assert a.reserved == 102 * MIB and a.result().segments == 2


def test_expandable_segments_split_any_rest_of_512_bytes_or_more():
    a = CachingAllocator(expandable_segments=True)
    a.malloc("a", 19 * MIB + MIB // 2)  # one 20 MiB page; the 0.5 MiB rest is split off (default: kept, see above)
    assert (a.reserved, a.allocated) == (20 * MIB, 19 * MIB + MIB // 2)


def test_expandable_best_fit_prefers_a_block_away_from_the_growing_end():
    a = CachingAllocator(expandable_segments=True)
    # One 20 MiB page: [A 6][B 2][C 5][D 2][free 5 | unmapped]
    for key, size in (("A", 6), ("B", 2), ("C", 5), ("D", 2)):
        a.malloc(key, size * MIB)
    a.free("A")  # free: 6 MiB at 0; 5 MiB at 15, which can grow into the unmapped space after it
    a.malloc("p", 5 * MIB)  # the 5 MiB block counts as 5 MiB + the unmapped rest, so A's 6 MiB is taken: 1 MiB left
    assert a.reserved == 20 * MIB
    a.malloc("q", 6 * MIB)  # no free 6 MiB: the 5 MiB at the end + 1 MiB of a new 20 MiB page
    assert a.reserved == 40 * MIB


def test_releasing_the_cache_gives_back_whole_segments_or_whole_free_pages():
    a = CachingAllocator()
    a.malloc("a", 3 * MIB)
    a.malloc("b", 18 * MIB)  # larger than the 17 MiB rest: its own 18 MiB segment
    a.free("b")
    a.release_cached_blocks()  # the 18 MiB segment is wholly free; the 20 MiB one holds a
    assert a.reserved == 20 * MIB
    e = CachingAllocator(expandable_segments=True)
    e.malloc("a", 30 * MIB)  # 40 MiB mapped
    e.malloc("b", 5 * MIB)  # at 30
    e.free("a")  # free [0, 30): page [0, 20) wholly free, [20, 30) shares its page with b
    e.release_cached_blocks()
    assert e.reserved == 20 * MIB


def test_a_device_capacity_releases_the_cache_then_retries():
    a = CachingAllocator(capacity_bytes=40 * MIB)
    a.malloc("a", 30 * MIB, "s")  # a 30 MiB segment (>= 10 MiB: rounded to 2 MiB)
    a.free("a")  # cached on stream s
    a.malloc("b", 11 * MIB, "t")  # another stream: a new 12 MiB segment; 30 + 12 > 40, so the cache is released
    assert (a.reserved, a.retries, a.peak_reserved) == (12 * MIB, 1, 30 * MIB)


def test_a_device_capacity_raises_memory_error_when_release_does_not_help():
    a = CachingAllocator(capacity_bytes=40 * MIB)
    a.malloc("a", 30 * MIB)
    with pytest.raises(MemoryError, match="out of memory"):
        a.malloc("b", 12 * MIB)  # 30 + 12 > 40 and a is live
    a.free("a")
    a.malloc("b", 12 * MIB)  # now the cached 30 MiB block fits (split: 18 MiB rest): no device memory, no retry
    assert (a.reserved, a.allocated, a.retries) == (30 * MIB, 12 * MIB, 1)


def test_the_replays_requested_peak_is_the_traces_own_running_maximum():
    rng = random.Random(0)
    events, live = [], []
    for key in range(400):
        if live and rng.random() < 0.45:
            events.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            events.append(("alloc", key, rng.choice([100, 4096, 3 * MIB, 25 * MIB + 7]), rng.choice("ab")))
            live.append(key)
    running, peak, sizes = 0, 0, {}  # counted here, independently of Trace.peak_bytes
    for event in events:
        if event[0] == "alloc":
            sizes[event[1]] = event[2]
            running += event[2]
        else:
            running -= sizes[event[1]]
        peak = max(peak, running)
    for expandable in (False, True):
        result = replay(events, expandable_segments=expandable)
        assert result.peak_requested_bytes == peak == Trace(tuple(events)).peak_bytes()
        assert result.peak_reserved_bytes >= result.peak_allocated_bytes >= result.peak_requested_bytes


def test_a_trace_repeated_frees_what_a_step_leaves_and_runs_it_again():
    trace = Trace((("alloc", "w", 100, "s"), ("alloc", "x", 50, "s"), ("alloc", "g", 30, "s"), ("free", "x")), 1)
    assert trace.repeated(2).events == (
        ("alloc", "w", 100, "s"),  # before the step: kept
        ("alloc", (0, "x"), 50, "s"),
        ("alloc", (0, "g"), 30, "s"),
        ("free", (0, "x")),
        ("free", (0, "g")),  # left by step 0 (a gradient), freed before step 1
        ("alloc", (1, "x"), 50, "s"),
        ("alloc", (1, "g"), 30, "s"),
        ("free", (1, "x")),
    )


def test_bad_traces_are_refused_with_a_sentence():
    with pytest.raises(ValueError, match="not live"):
        replay([("free", 1)])
    with pytest.raises(ValueError, match="already live"):
        replay([("alloc", 1, 10, "s"), ("alloc", 1, 10, "s")])
    with pytest.raises(ValueError, match="unknown event"):
        replay([("move", 1)])


def test_optimizer_state_deferred_to_the_first_steps_optimizer_is_kept_across_repeats():
    trace = Trace(
        (
            ("alloc", "w", 100, "s"),
            ("alloc", "m", 40, "s"),
            ("alloc", "x", 50, "s"),
            ("free", "x"),
            ("alloc", "g", 30, "s"),
        ),
        2,
        groups={"parameters": ("w",), "optimizer state": ("m",)},
        marks={"optimizer": 5},  # after the step's last event: where optimizer.step() starts
    )
    lazy = trace.deferred("optimizer state", "optimizer")
    assert lazy.events == (
        ("alloc", "w", 100, "s"),
        ("alloc", "x", 50, "s"),
        ("free", "x"),
        ("alloc", "g", 30, "s"),
        ("alloc", "m", 40, "s"),  # created by the first optimizer.step()
    )
    assert lazy.repeated(2).events == (
        ("alloc", "w", 100, "s"),
        ("alloc", (0, "x"), 50, "s"),
        ("free", (0, "x")),
        ("alloc", (0, "g"), 30, "s"),
        ("alloc", "m", 40, "s"),
        ("free", (0, "g")),  # the gradient goes before the next step; the optimizer state stays
        ("alloc", (1, "x"), 50, "s"),
        ("free", (1, "x")),
        ("alloc", (1, "g"), 30, "s"),
    )
