"""Rendered graph pages are kept per capture and view, each use with a nonce of its own."""

import gc
import re

from graphviz_core.export.render import render_html
from graphviz_core.ui import graph_pages
from graphviz_core.ui.graph_pages import NONCE_MARK, graph_page
from tests.conftest import captured


class Owner:
    """Stands in for a capture: any object a weak reference can point at."""


def counting(graph):
    calls = []

    def render(nonce):
        calls.append(nonce)
        return render_html(graph, nonce=nonce)

    return calls, render


def nonces(page: str) -> set[str]:
    return set(re.findall(r'nonce="([^"]+)"', page)) | set(re.findall(r"'nonce-([^']+)'", page))


def test_a_view_is_rendered_once_and_every_page_gets_its_own_nonce():
    graph, owner = captured("mlp").graph, Owner()
    calls, render = counting(graph)
    first, second = graph_page(owner, ("whole",), render), graph_page(owner, ("whole",), render)
    assert calls == [NONCE_MARK]  # the second page came from the cache
    assert NONCE_MARK not in first + second
    (a,), (b,) = nonces(first), nonces(second)  # one nonce per page, in the policy and on every script
    assert a != b and first.replace(a, b) == second
    graph_page(owner, ("hide_shape",), render)
    assert len(calls) == 2  # another view of the same capture is a page of its own


def test_another_capture_at_a_freed_captures_address_is_rendered_again(monkeypatch):
    # CPython hands a freed capture's memory (its id) to a later object: every object gets the same id here
    monkeypatch.setattr(graph_pages, "id", lambda _: 12345, raising=False)
    graph = captured("mlp").graph
    calls, render = counting(graph)
    owner = Owner()
    graph_page(owner, ("whole",), render)
    graph_page(owner, ("whole",), render)
    assert len(calls) == 1
    del owner
    gc.collect()
    graph_page(Owner(), ("whole",), render)  # same key, but not the capture the page was drawn for
    assert len(calls) == 2


def test_pages_beyond_the_byte_limit_go_least_recently_used_first(monkeypatch):
    graph, owner = captured("mlp").graph, Owner()
    calls, render = counting(graph)
    size = len(render_html(graph, nonce=NONCE_MARK))
    monkeypatch.setattr(graph_pages, "MAX_BYTES", 2 * size)  # room for two pages
    for view in ("a", "b", "a", "c"):  # "a" used again after "b": "b" is the least recently used when "c" comes
        graph_page(owner, (view,), render)
    assert len(calls) == 3
    graph_page(owner, ("a",), render)
    assert len(calls) == 3  # still kept
    graph_page(owner, ("b",), render)
    assert len(calls) == 4  # had been let go
