"""Numbers as people read them: bytes (KiB/MiB/GiB), FLOPs (kFLOP…PFLOP), seconds (µs/ms/s), ratios, and the
unit a chart axis should use. Core and UI share these (the core's sentences carry units too)."""

from __future__ import annotations

import math


def _scaled(value: float, base: float, units: tuple[str, ...], decimals_of) -> tuple[str, str]:
    """The first unit in which `value`, rounded as it will be printed, stays below `base`.

    Rounding first is what keeps thresholds honest: 1023.96 B prints as "1.0 KiB", never "1024.0 KiB".
    """
    for i, unit in enumerate(units):
        decimals = decimals_of(unit)
        rounded = round(value, decimals)
        if abs(rounded) < base or i == len(units) - 1:
            return f"{rounded:.{decimals}f}", unit
        value /= base
    raise AssertionError("unreachable")


def format_bytes(n: int | float | None) -> str:
    """1536 -> "1.5 KiB"; whole bytes below 1 KiB ("512 B"); binary units up to TiB."""
    if n is None:
        return "n/a"
    number, unit = _scaled(float(n), 1024, ("B", "KiB", "MiB", "GiB", "TiB"), lambda u: 0 if u == "B" else 1)
    return f"{number} {unit}"


def format_flops(n: int | float | None, suffix: str = "FLOP") -> str:
    """37_203_968 -> "37.2 MFLOP"; suffix="FLOP/s" for rates. Decimal prefixes up to E."""
    if n is None:
        return "n/a"
    number, prefix = _scaled(float(n), 1000, ("", "k", "M", "G", "T", "P", "E"), lambda p: 0 if p == "" else 1)
    return f"{number} {prefix}{suffix}".rstrip()


def format_seconds(s: float | None) -> str:
    """0.0000123 -> "12 µs", 0.0123 -> "12.3 ms", 12.3 -> "12.30 s"; 1e300 -> "1e+300 s" (from a million seconds up,
    three significant digits); NaN and infinity -> "n/a" (a step at 1e-320 TFLOP/s overflowed round())."""
    if s is None or not math.isfinite(s):
        return "n/a"
    if abs(s) >= 1e6:
        return f"{s:.3g} s"
    if round(s * 1e6) < 1000:
        return f"{s * 1e6:.0f} µs"
    if round(s * 1e3, 1) < 1000:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def format_ratio(x: float | None) -> str:
    """2.4999 -> "2.50×" (how many times)."""
    return "n/a" if x is None else f"{x:.2f}×"


def bytes_unit(largest: int | float) -> tuple[str, int]:
    """The unit a chart's byte axis should use so its largest value reads as 1-1023: ("MiB", 2**20)."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if abs(largest) >= 1024**power:
            return unit, 1024**power
    return "B", 1


def flops_unit(largest: int | float, suffix: str = "FLOP") -> tuple[str, float]:
    """The unit a chart's FLOP axis should use so its largest value reads as 1-999: ("MFLOP", 1e6)."""
    for power, prefix in ((15, "P"), (12, "T"), (9, "G"), (6, "M"), (3, "k")):
        if abs(largest) >= 10**power:
            return prefix + suffix, 10.0**power
    return suffix, 1.0


def format_intensity(x: float | None) -> str:
    """Arithmetic intensity: 5.69 -> "5.7 FLOP/B" (FLOPs per byte read and written)."""
    if x is None:
        return "n/a"
    return f"{x:.2f} FLOP/B" if x < 10 else f"{x:,.0f} FLOP/B" if x >= 1000 else f"{x:.1f} FLOP/B"


def format_in(unit: str, value: float, plain: str = "{:,.0f}") -> str:
    """`value` in `unit` ("bytes", "FLOP", "s"), scaled as above; any other unit with the `plain` format."""
    if unit == "bytes":
        return format_bytes(value)
    if unit == "FLOP":
        return format_flops(value)
    if unit == "s":
        return format_seconds(value)
    return plain.format(value)


def some_of(names, shown: int) -> str:
    """The first `shown` of `names` as a sentence lists them: "a, b, c and 4 more"."""
    names = list(names)
    more = len(names) - shown
    return ", ".join(map(str, names[:shown])) + (f" and {more:,} more" if more > 0 else "")


def finite_or_null(value, places: list[str], where: str = ""):
    """`value` (nested dicts, lists and tuples) with every float that is not finite (NaN, ±inf: not JSON) replaced by
    None, each such place (`layouts[0].estimate.step_time_s`) appended to `places`."""
    if isinstance(value, float) and not math.isfinite(value):
        places.append(where or "(top)")
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v, places, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v, places, f"{where}[{i}]") for i, v in enumerate(value)]
    return value
