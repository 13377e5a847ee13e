"""Rendered graph pages kept per capture and view: a view drawn before, in any session, is not laid out again.

Laying out and rendering a graph's page takes ~5 ms for gpt2-tiny, 30 ms for gpt2-small, 0.1-0.3 s for the
2,612 nodes of Llama-3.1-8B on this machine: paid again on every toggle back, every new session opening a cached
config and every rerun. Pages are kept in memory (bounded by bytes, least recently used out) and tied to the
capture object itself (a weak reference: a capture the shared cache let go is never matched again). Each use
gets a fresh Content-Security-Policy nonce, so no two frames share one.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable

MAX_BYTES = 64 * 2**20  # ~36 pages of Llama-3.1-8B's whole graph (1.76 MB each)
# What the page is rendered with as its nonce and replaced on every use: random, so no graph text can hold it
NONCE_MARK = "n" + secrets.token_hex(16)

_lock = threading.Lock()
_pages: OrderedDict[tuple, tuple[weakref.ref, str]] = OrderedDict()
_held = {"bytes": 0}


def graph_page(capture: object, view: Hashable, render: Callable[[str], str]) -> str:
    """The page `render(nonce)` draws for `capture` and `view` (everything else the page depends on), rendered
    once and kept; returned with a nonce of its own."""
    key = (id(capture), view)
    with _lock:
        kept = _pages.get(key)
        page = kept[1] if kept is not None and kept[0]() is capture else None
        if page is not None:
            _pages.move_to_end(key)
    if page is None:
        page = render(NONCE_MARK)
        with _lock:
            old = _pages.pop(key, None)
            _held["bytes"] -= len(old[1]) if old else 0
            _pages[key] = (weakref.ref(capture), page)
            _held["bytes"] += len(page)
            while _held["bytes"] > MAX_BYTES and len(_pages) > 1:
                _, (_, gone) = _pages.popitem(last=False)
                _held["bytes"] -= len(gone)
    return page.replace(NONCE_MARK, secrets.token_urlsafe(16))
