"""Human-readable numbers for the UI: bytes, FLOPs, seconds. The core returns raw numbers; this formats them."""

from __future__ import annotations


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
