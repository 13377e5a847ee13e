"""The one store of shared results the pages use (graphviz_core.serve.recent.Recent): the most recently used kept."""

import threading

import pytest

from graphviz_core.serve.recent import Recent


def test_reading_a_result_keeps_it_and_the_oldest_unread_goes():
    store = Recent(2)
    store.put("a", 1)
    store.put("b", 2)
    assert store.get("a") == 1  # now a is the most recent
    store.put("c", 3)  # past 2: the oldest, b, goes
    assert "b" not in store and store.get("a") == 1 and store.get("c") == 3 and len(store) == 2
    store.put("a", 4)  # a new value for a key replaces the old and is the most recent
    store.put("d", 5)
    assert "c" not in store and store.get("a") == 4


def test_many_threads_never_hold_more_than_its_size():
    store = Recent(8)

    def fill(start: int) -> None:
        for i in range(start, start + 500):
            store.put(i, i)
            store.get(i - 3)

    threads = [threading.Thread(target=fill, args=(1000 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store) == 8


def test_a_store_of_nothing_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        Recent(0)
