"""Runs captures, and the pages' other long work (graphviz_core.serve.work), through the process-wide shared store:
one result per config (or request) for every session, its queue position or progress and a Cancel button while it
waits or runs, and where a capture came from once it is there."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Hashable
from typing import Any

import streamlit as st
from streamlit.runtime import Runtime
from streamlit.runtime.scriptrunner import get_script_run_ctx

from graphviz_core.capture.admission import CaptureCancelled
from graphviz_core.capture.result import Capture
from graphviz_core.capture.workers import runs_elsewhere
from graphviz_core.config import ModelConfig
from graphviz_core.serve.shared_captures import Cached, Job, Work, shared_captures
from graphviz_core.ui.config_form import in_form_words, refuse
from graphviz_core.ui.format import escape_markdown, format_bytes, format_seconds
from graphviz_core.ui.links import apply_pending_view

POLL_S = 0.3  # how often the waiting page refreshes its line (and notices a click on Cancel)


def _session_id() -> str:
    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else "no-session"


def _session_alive(session_id: str) -> bool:
    """Whether the browser session is still connected (a closed tab cancels what only it waited for)."""
    if not Runtime.exists():  # AppTest and bare scripts: no server, nobody can go away
        return True
    return Runtime.instance().is_active_session(session_id)


shared_captures().alive = _session_alive


def _key(config: Hashable) -> str:
    return hashlib.sha1(repr(config).encode()).hexdigest()[:12]


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def _name(config: ModelConfig) -> str:
    return (f"preset {config.preset}: " if config.preset else "") + config.describe()


def _cancel(asked: Hashable, key: Hashable, said: str) -> None:
    """Cancel button callback: this browser session stops waiting for the job at `key` (asked for as `asked`: a
    capture's config, or the work's key); it stops when nobody else waits for it."""
    st.session_state.setdefault("capture.cancelled", {})[asked] = said
    job = shared_captures().in_flight_key(key)
    if job is not None:
        shared_captures().withdraw(job, _session_id())


def _capture_again(config: ModelConfig) -> None:
    st.session_state.setdefault("capture.cancelled", {}).pop(config, None)


def _waiting_line(job: Job) -> str:
    device = job.ticket.device or "the device"
    others = len(job.waiters) - 1
    shared = f" · shared with {others} other session{'s' if others != 1 else ''}" if others > 0 else ""
    ahead = job.ahead()
    if ahead:
        return f"Waiting for room on {device}: {ahead} ahead of you · {time.time() - job.started_at:.0f} s{shared}"
    doing = job.what if job.fraction is not None else job.phase  # with a fraction, the bar below says the phase
    return f"{doing[:1].upper()}{doing[1:].rstrip('…')}… {time.time() - job.started_at:.0f} s{shared}"


QUIET_S = 0.3  # a capture done within this long is never drawn waiting for


def _wait(job: Job) -> None:
    """Show the job's queue position or phase until it ends, with a Cancel button.

    Nothing is drawn for the first QUIET_S: drawing the box is ~50-80 ms of this thread's Python, plus the server
    sending it and the browser fetching and running its scripts, all while the capture's timed forward and backward
    ran (gpt2-tiny's are ~20 ms each) and waited for the interpreter lock and the cores: the first capture after a
    start read "Timing disturbed" at 15-30%. A capture that is done by then is simply shown.
    The loop redraws its line every POLL_S; a click on Cancel (or any widget) makes Streamlit stop this run at
    the next redraw and rerun the page, where the button's callback has withdrawn this browser session from the job.
    """
    box = st.empty()
    if job.done.wait(QUIET_S):
        return
    asked = job.config if job.config is not None else job.key
    with box.container(border=True):
        line = st.empty()
        line.info(_waiting_line(job))
        bar = st.empty()
        st.button(
            "Cancel",
            key=f"capture.cancel.{_key(job.key)}",
            on_click=_cancel,
            args=(asked, job.key, "Capture cancelled." if job.config is not None else f"Cancelled: {job.what}."),
            help="Stops waiting for this; it stops at its next node or op unless another session waits for it too",
        )
    while not job.done.wait(POLL_S):
        line.info(_waiting_line(job))
        if job.fraction is not None:
            bar.progress(min(1.0, max(0.0, job.fraction)), text=escape_markdown(job.phase[:1].upper() + job.phase[1:]))
    box.empty()


def _show_origin(cached: Cached, measured_now: bool) -> None:
    capture = cached.capture
    took = (capture.time.forward_s or 0) + (capture.time.backward_s or 0)
    what = f"{capture.summary.nodes:,} nodes on {capture.device}" + (
        f" in {format_seconds(took)}" if capture.time.forward_s is not None else " (shapes only)"
    )
    if measured_now:
        line = f"Captured {what} · measured now, at {_clock(cached.measured_at)}"
    else:
        line = f"From the shared cache: {what}, measured at {_clock(cached.measured_at)} by an earlier run"
    load = shared_captures().load()
    line += (
        f" · shared cache {load.entries} of {load.max_entries} results, "
        f"{format_bytes(load.retained_bytes)} of {format_bytes(load.max_bytes)}"
    )
    st.caption(line)
    if measured_now and cached.evicted:
        gone = ", ".join(
            f"{escape_markdown(_name(e.config) if e.config is not None else e.what)} ({format_bytes(e.retained_bytes)})"
            for e in cached.evicted
        )
        st.caption(f"Evicted {gone} from the shared cache to make room (least recently used first).")
    if not cached.kept:
        st.caption(
            f"Not kept in the shared cache: this capture alone ({format_bytes(cached.retained_bytes)}) is larger "
            "than the cache's limit (GRAPHVIZ_CORE_CACHE_MAX_BYTES)."
        )


def is_captured(config: ModelConfig) -> bool:
    """Whether the shared cache holds `config`'s capture now (get_capture then returns without waiting)."""
    return shared_captures().lookup(config) is not None


def start_capture(config: ModelConfig) -> None:
    """Start capturing `config` now, without waiting for it, where it runs in another process (a meta dry run): a page
    that needs two captures then waits for both at once instead of one after the other. Anything else starts when
    get_capture asks for it (two CPU captures at once would time each other)."""
    if runs_elsewhere(config) and config not in st.session_state.get("capture.cancelled", {}):
        if isinstance(shared_captures().request(config, _session_id()), Job):  # measured now, for this page
            st.session_state.setdefault("capture.measured", {})[config] = None


def _said_cancelled(asked: Hashable, button: str, prefix: str) -> bool:
    """Whether this browser session cancelled `asked` (a capture's config, or a work's key); if so, the notice of why
    it stopped and a button to ask again are drawn."""
    cancelled = st.session_state.setdefault("capture.cancelled", {})
    if asked not in cancelled:
        return False
    st.warning(escape_markdown(cancelled[asked]))
    st.button(button, key=f"{prefix}.{_key(asked)}", on_click=_capture_again, args=(asked,))
    return True


def get_capture(config: ModelConfig, form_key: str | None = None, origin: bool = True) -> Capture | None:
    """The capture of `config` from the shared cache, or captured now (waiting with everyone who asked for the same
    config); None after showing an st.error, or a cancelled notice, when there is no result. A capture refused with a
    sentence takes the form `form_key` back to the config it ran before (config_form.refuse), as a refused Run does."""
    store = shared_captures()
    # config -> measured_at of the result this browser session waited for (None while waiting); times, not captures, so
    # that sessions never keep an evicted capture alive
    measured = st.session_state.setdefault("capture.measured", {})
    cancelled = st.session_state.setdefault("capture.cancelled", {})  # config -> why it stopped
    got = store.lookup(config)
    if got is None and _said_cancelled(config, "Capture again", "capture.again"):
        return None
    if got is None:
        got = store.request(config, _session_id())
    if isinstance(got, Job):
        measured[config] = None  # this browser session waits for it: its result is "measured now" here
        _wait(got)
        if got.error is not None:
            if isinstance(got.error, CaptureCancelled):
                cancelled[config] = f"Capture stopped: {got.error}."
                return get_capture(config)
            if isinstance(got.error, ValueError):
                if form_key is not None and refuse(form_key, config, str(got.error)):
                    st.rerun()  # the form's previous config, with the sentence above its result
                st.error(escape_markdown(in_form_words(str(got.error), config.model)))
                return None
            raise got.error
        got = got.result
    cancelled.pop(config, None)
    if config in measured and measured[config] is None:
        measured[config] = got.measured_at
    if origin:  # where the capture came from (measured now, or the shared cache); a table of several says it once
        _show_origin(got, measured.get(config) == got.measured_at)
    apply_pending_view(config, got.capture.graph)  # a link's focused/expanded module, now that its modules are known
    return got.capture


def get_result(key: Hashable, work: Work, what: str) -> Any | None:
    """The shared result of `work` (named by `key`: everything it depends on), from the store or run now, queued with
    everyone's work, its line, progress and Cancel button drawn while it waits or runs; None after a notice that it
    was cancelled, with a button to run it again. A refusal (ValueError, a sentence) is raised to the caller, which
    says it in its own words."""
    store = shared_captures()
    cancelled = st.session_state.setdefault("capture.cancelled", {})  # key -> why it stopped
    got = store.lookup_key(key)
    if got is None and _said_cancelled(key, "Run again", "work.again"):
        return None
    if got is None:
        got = store.request_work(key, _session_id(), work, what)
    if isinstance(got, Job):
        _wait(got)
        if got.error is not None:
            if isinstance(got.error, CaptureCancelled):
                cancelled[key] = f"{what[:1].upper()}{what[1:]} stopped: {got.error}."
                return get_result(key, work, what)
            raise got.error
        got = got.result
    cancelled.pop(key, None)
    return got.value


def get_captures(configs: list[ModelConfig]) -> list[Capture] | None:
    """The captures of `configs`, for a table built from several (each through get_capture: queued, limited, with its
    Cancel button, cached for every session); dry runs started together. None while one is refused or cancelled
    (said by get_capture)."""
    for each in configs:
        start_capture(each)
    captures = [get_capture(each, origin=False) for each in configs]  # every one asked for, each wait drawn
    return None if any(c is None for c in captures) else captures


def asked_result(state_key: str, asked: tuple | None) -> Any | None:
    """Work a button asks for, waited for in the run the button was pressed (`asked`: (key, work, what) for
    get_result; None on other runs) and in the reruns after it, until it ends; its result is kept in the session under
    `state_key`, so a later rerun shows it and never runs it again. A refusal is an st.error. Returns the result kept
    (the one before, while a new one runs or after a refusal), or None."""
    pending_key = f"{state_key}.asked"
    if asked is not None:
        st.session_state[pending_key] = asked
        st.session_state.get("capture.cancelled", {}).pop(asked[0], None)  # a press asks again, cancelled or not
    if (pending := st.session_state.get(pending_key)) is not None:
        try:
            result = get_result(*pending)
        except ValueError as exc:
            result = None
            del st.session_state[pending_key]
            st.error(escape_markdown(str(exc)))
        if result is not None:
            st.session_state[state_key] = result
            del st.session_state[pending_key]
    return st.session_state.get(state_key)
