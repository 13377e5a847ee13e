"""Human-readable numbers for the UI: bytes, FLOPs, seconds. The core returns raw numbers; this formats them."""

from __future__ import annotations

import re


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_flops(n: int | float | None, suffix: str = "FLOP") -> str:
    """37_203_968 -> "37.2 MFLOP" (or "37.2 M" with suffix="", where the label already says FLOPs)."""
    if n is None:
        return "n/a"
    value = float(n)
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(value) < 1000 or prefix == "P":
            return f"{value:.0f} {suffix}".rstrip() if not prefix else f"{value:.1f} {prefix}{suffix}"
        value /= 1000
    return f"{value:.1f} P{suffix}"


def format_seconds(s: float | None) -> str:
    if s is None:
        return "n/a"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


# Every ASCII punctuation mark CommonMark lets a backslash escape, except quotes and commas (never markup).
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
