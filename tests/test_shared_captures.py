"""The shared capture store: one capture per config for everyone, bounded by bytes and entries with visible
evictions, and captures cancelled when their last waiter withdraws or goes away."""

import sys
import threading
import time

import pytest

from graphviz_core.capture.admission import POLL_S, CaptureCancelled, admission
from graphviz_core.capture.engine import capture_backward
from graphviz_core.config import ModelConfig, config_from_preset
from graphviz_core.serve.shared_captures import Cached, Job, SharedCaptures, retained_bytes
from tests.conftest import captured

TINY = config_from_preset("gpt2-tiny", device="cpu")


class CountingCapture:
    """The real capture_backward, counting its calls and optionally held at 'building the model' until released."""

    def __init__(self, hold: bool = False) -> None:
        self.calls = 0
        self.started = threading.Event()
        self.gate = threading.Event()
        if not hold:
            self.gate.set()

    def __call__(self, config, progress=None, ticket=None):
        self.calls += 1

        def held(phase):
            if progress:
                progress(phase)
            if phase == "building the model":
                self.started.set()
                assert self.gate.wait(60)

        return capture_backward(config, progress=held, ticket=ticket)


def _result(got):
    if isinstance(got, Job):
        assert got.done.wait(120)
        if got.error is not None:
            raise got.error
        return got.result
    return got


def test_two_sessions_asking_for_one_config_at_once_share_one_capture():
    counting = CountingCapture(hold=True)
    store = SharedCaptures(capture=counting)
    first = store.request(TINY, "session-1")
    assert counting.started.wait(60)  # session 1's capture is running (held)
    second = store.request(TINY, "session-2")
    assert second is first and first.waiters == {"session-1", "session-2"}
    counting.gate.set()
    a, b = _result(first), _result(second)
    assert counting.calls == 1 and a is b
    assert a.capture.loss == captured("gpt2-tiny").loss  # the same number the CLI's capture gives
    assert store.request(TINY, "session-3") is a  # a third, later: straight from the cache, still one capture
    assert counting.calls == 1


def test_the_cache_is_bounded_by_entries_and_says_what_it_evicted(monkeypatch):
    monkeypatch.setenv("GRAPHVIZ_CORE_CACHE_MAX_ENTRIES", "2")
    store = SharedCaptures()
    seeds = [TINY.replace(seed=s) for s in (1, 2, 3)]
    kept = [_result(store.request(c, "s")) for c in seeds]
    assert kept[0].evicted == kept[1].evicted == ()
    # the third entry over a limit of 2 evicts the least recently used: seed 1
    assert [e.config for e in kept[2].evicted] == [seeds[0]]
    assert kept[2].evicted[0].retained_bytes == kept[0].retained_bytes
    assert store.lookup(seeds[0]) is None and store.lookup(seeds[1]) is kept[1]
    load = store.load()
    assert (load.entries, load.retained_bytes) == (2, kept[1].retained_bytes + kept[2].retained_bytes)


def test_the_cache_is_bounded_by_bytes(monkeypatch):
    store = SharedCaptures()
    one = _result(store.request(TINY.replace(seed=1), "s"))
    # room for one gpt2-tiny capture and a half: the second evicts the first; 101 nodes retain ~0.2 MB each
    monkeypatch.setenv("GRAPHVIZ_CORE_CACHE_MAX_BYTES", str(int(one.retained_bytes * 1.5)))
    two = _result(store.request(TINY.replace(seed=2), "s"))
    assert [e.config.seed for e in two.evicted] == [1]
    assert store.load().entries == 1
    # a capture larger than the whole cache is handed over but not kept (and evicts nothing for nothing)
    monkeypatch.setenv("GRAPHVIZ_CORE_CACHE_MAX_BYTES", str(one.retained_bytes // 2))
    three = _result(store.request(TINY.replace(seed=3), "s"))
    assert not three.kept and three.evicted == () and store.load().entries == 1


def test_withdrawing_cancels_only_when_nobody_else_waits():
    counting = CountingCapture(hold=True)
    store = SharedCaptures(capture=counting)
    job = store.request(TINY.replace(seed=11), "a")
    store.request(TINY.replace(seed=11), "b")
    assert counting.started.wait(60)
    assert store.withdraw(job, "a") is False and not job.ticket.cancelled  # b still waits
    assert store.withdraw(job, "b") is True
    counting.gate.set()  # it resumes, reaches the next module boundary and stops there
    assert job.done.wait(60)
    assert isinstance(job.error, CaptureCancelled) and job.result is None
    assert store.lookup(TINY.replace(seed=11)) is None
    assert admission().load("cpu").reserved_bytes == 0
    # asked again after the cancel: a fresh capture, not the cancelled one
    again = store.request(TINY.replace(seed=11), "a")
    assert again is not job
    assert isinstance(_result(again), Cached) and counting.calls == 2


def test_a_capture_whose_sessions_all_went_away_is_cancelled():
    gone: set[str] = set()
    counting = CountingCapture(hold=True)
    store = SharedCaptures(capture=counting, alive=lambda waiter: waiter not in gone)
    job = store.request(TINY.replace(seed=12), "tab")
    assert counting.started.wait(60)
    gone.add("tab")  # the tab was closed mid-capture
    time.sleep(POLL_S + 0.05)  # the ticket asks `alive` at most every POLL_S; let the next check ask
    counting.gate.set()
    assert job.done.wait(60)
    assert isinstance(job.error, CaptureCancelled) and "nobody is waiting" in str(job.error)
    assert admission().load("cpu").running == 0


def test_a_refused_config_reaches_every_waiter_as_its_sentence(monkeypatch):
    monkeypatch.setenv("GRAPHVIZ_CORE_CAPTURE_MAX_BYTES", "1000")
    store = SharedCaptures()
    with pytest.raises(ValueError, match="allows one capture at most"):
        _result(store.request(TINY.replace(seed=13), "s"))
    assert store.in_flight(TINY.replace(seed=13)) is None and store.load().entries == 0


def test_retained_bytes_counts_each_object_once():
    words = [f"{i:0100d}" for i in range(1000)]  # 1000 distinct 100-character strings
    # the list itself plus each string once; the second reference to words[0] adds nothing
    expected = sys.getsizeof(words + [words[0]]) + sum(sys.getsizeof(w) for w in words)
    assert retained_bytes(words + [words[0]]) == expected
    assert retained_bytes(captured("gpt2-tiny")) > 101 * 500  # 101 nodes, each a dict of 8+ attributes


def test_one_config_named_three_ways_is_one_capture():
    counting = CountingCapture()
    store = SharedCaptures(capture=counting)
    by_name = _result(store.request(config_from_preset("gpt2-tiny"), "a"))  # device auto: cpu in the tests
    typed = ModelConfig(model="gpt2", hidden=64, heads=4, layers=2, vocab=512, batch=2, seq=32, device="cpu")
    assert store.request(typed, "b") is by_name and store.request(TINY, "c") is by_name
    assert counting.calls == 1
