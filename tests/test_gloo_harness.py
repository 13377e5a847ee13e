"""The two-process harness the distributed tests use (tests/gloo.py): its rendezvous is served by the test's own
process on a port it holds from the start (no port found free, let go and taken by another connection before rank 0
binds it), and a rank that raises is reported with its traceback at once, not after the whole timeout."""

import time

import pytest
import torch.multiprocessing as mp

from tests.gloo import gloo_group, spawn_ranks


def _raising(rank, world, port, results):
    with gloo_group(rank, world, port):
        if rank == 1:
            raise RuntimeError("rank 1 broke on purpose")
        results.put("rank 0 finished")


def _summing(rank, world, port, results):
    import torch
    import torch.distributed as dist

    with gloo_group(rank, world, port):
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value)
        if rank == 0:
            results.put(float(value))


def test_two_ranks_meet_and_sum():
    assert spawn_ranks(_summing, 2) == 3.0  # 1 + 2, over the store this process serves


def test_a_rank_that_raises_is_reported_at_once():
    started = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException) as raised:
        spawn_ranks(_raising, 2, timeout=60)
    assert time.monotonic() - started < 50  # a traceback, not the 60 s timeout
    # whichever rank's failure is seen first, with its traceback: rank 1's own error, or rank 0's barrier finding its
    # peer gone (gloo words that several ways)
    assert "terminated with the following error" in str(raised.value) and "Traceback" in str(raised.value)
