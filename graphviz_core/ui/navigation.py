"""Keeps every page behind app.py's st.navigation, even when a page URL is the first request.

Because this project's pages live in `pages/` beside app.py, Streamlit starts each
process in its legacy multipage mode: until some session has run app.py's `st.navigation`, a request for
`/toy_expressions` runs the page file on its own — no page config, the legacy sidebar list. A page that
finds itself run that way switches the process to app.py's navigation and reruns itself through it (the
page's id is the hash of its URL path in both modes, so the same page comes back).
"""

from __future__ import annotations

import os
import sys

import streamlit as st
from streamlit.runtime.pages_manager import PagesManager


def run_through_app() -> None:
    """Call first in every page file. Only on a real server: AppTest resets the flag before every run (its
    reruns are legacy-mode by design), and a rerun there would drop the widget interaction under test."""
    under_app_test = "streamlit.testing.v1.app_test" in sys.modules  # never imported by a real server
    if PagesManager.uses_pages_directory and not under_app_test:
        PagesManager.uses_pages_directory = False  # what st.navigation does when app.py runs
        st.rerun()
    require_sign_in()


REQUIRE_LOGIN_ENV = "GRAPHVIZ_CORE_REQUIRE_LOGIN"


def require_sign_in() -> None:
    """With GRAPHVIZ_CORE_REQUIRE_LOGIN=1 (off by default), nothing but a sign-in button is shown until the visitor
    signed in through Streamlit's OpenID Connect login (st.login; the provider is set in .streamlit/secrets.toml's
    [auth] table and needs the Authlib package; docs/team-server.md, "Require sign-in in the app itself")."""
    if os.environ.get(REQUIRE_LOGIN_ENV, "").strip() not in ("1", "true", "yes"):
        return
    if getattr(st.user, "is_logged_in", False):  # the attribute exists only where a login provider is configured
        return
    st.title("Backprop, visible")
    if not _login_configured():  # fail closed: sign-in was asked for, and nobody can sign in yet
        st.error(
            f"This server requires sign-in ({REQUIRE_LOGIN_ENV}) but no login provider is configured: its operator "
            "adds an [auth] table to .streamlit/secrets.toml (docs/team-server.md, 'Require sign-in in the app itself')."
        )
        st.stop()
    st.info("This server asks you to sign in before it runs anything.")
    st.button("Sign in", type="primary", on_click=st.login)
    st.stop()


def _login_configured() -> bool:
    try:
        return "auth" in st.secrets
    except Exception:  # noqa: BLE001 - no secrets file at all (StreamlitSecretNotFoundError) or an unreadable one
        return False
