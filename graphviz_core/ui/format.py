"""Human-readable numbers for the UI (graphviz_core.units) and escaping of user text before Streamlit shows it."""

from __future__ import annotations

import re

from graphviz_core.units import (  # noqa: F401 - re-exported for the pages and panels
    bytes_unit,
    flops_unit,
    format_bytes,
    format_flops,
    format_intensity,
    format_ratio,
    format_seconds,
)

_MARKDOWN_SPECIAL = frozenset("\\`*_{}[]()<>#+-.!|~:$&=^%@/;?")
# GFM turns bare URLs and e-mail addresses into links after escapes are resolved, so backslashes cannot
# stop it; an invisible word joiner inside "http:", "www." and after "@" does.
_AUTOLINK = re.compile(r"(?i)(https?|ftp|mailto|xmpp|www)(\\[:.])|(\\@)")
WORD_JOINER = "\u2060"


def escape_markdown(text: object) -> str:
    """Text that Streamlit's Markdown shows literally: no links, images, emphasis, :directives: or $LaTeX$.

    For anything a user typed (or an error message that echoes it) that reaches st.error, st.caption,
    st.markdown or a widget label: every mark that could start markup is backslash-escaped, and bare URLs
    get an invisible word joiner so they are not turned into links.
    """
    escaped = "".join("\\" + ch if ch in _MARKDOWN_SPECIAL else ch for ch in str(text))
    escaped = _AUTOLINK.sub(lambda m: m.group(1) + WORD_JOINER + m.group(2) if m.group(1) else m.group(3) + WORD_JOINER,
                            escaped)
    return escaped.replace("\n", "  \n")


def literal_cells(frame):
    """A copy of the pandas DataFrame `frame` whose text cells, index and headers st.table shows as written: st.table
    renders them as Markdown, so '+ attention term' became a bullet and a module's `__init__` would turn bold."""
    def cell(value: object) -> object:
        return escape_markdown(value) if isinstance(value, str) else value

    shown = frame.map(cell)
    shown.index = shown.index.map(cell)
    shown.columns = shown.columns.map(cell)
    return shown
