"""Units at their thresholds: rounding picks the unit, so no "1024.0 KiB" or "1000.0 kFLOP" is ever printed."""

import pytest

from graphviz_core.ui.format import format_bytes, format_flops, format_seconds


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1023.6, "1.0 KiB"),  # rounds to 1024 B, so it is shown in the next unit
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (1024 * 1024 - 1, "1.0 MiB"),  # 1023.999 KiB rounds to 1024.0 KiB -> next unit
        (1024 * 1023.94, "1023.9 KiB"),  # rounds to 1023.9, stays in KiB
        (3 * 1024**3, "3.0 GiB"),
        (2048 * 1024**4, "2048.0 TiB"),  # the last unit takes any size
    ],
)
def test_bytes_at_thresholds(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    "n, text",
    [
        (999, "999 FLOP"),
        (999.6, "1.0 kFLOP"),  # rounds to 1000 FLOP -> next prefix
        (999_949, "999.9 kFLOP"),
        (999_950, "1.0 MFLOP"),  # 999.95 k rounds to 1000.0 k -> next prefix
        (37_203_968, "37.2 MFLOP"),  # gpt2-tiny's backward
        (2.6e15, "2.6 PFLOP"),
    ],
)
def test_flops_at_thresholds(n, text):
    assert format_flops(n) == text


def test_flop_rates_carry_per_second():
    assert format_flops(13.04e9, suffix="FLOP/s") == "13.0 GFLOP/s"


@pytest.mark.parametrize(
    "s, text", [(0.0009996, "1.0 ms"), (0.99996, "1.00 s"), (0.9999, "999.9 ms"), (0.0123, "12.3 ms"), (12e-6, "12 µs")]
)
def test_seconds_at_thresholds(s, text):
    assert format_seconds(s) == text


def test_missing_values_say_so():
    assert format_bytes(None) == format_flops(None) == format_seconds(None) == "n/a"


def test_table_cells_are_shown_as_written():
    """st.table renders its cells as Markdown: the FLOPs tab's '+ attention term 12·L·b·s²·h' row became a bullet
    ('• attention term …'). literal_cells escapes text cells, the index and the headers; numbers stay numbers."""
    import pandas as pd

    from graphviz_core.ui.format import escape_markdown, literal_cells

    frame = pd.DataFrame([{"term": "+ attention term 12·L·b·s²·h", "why": "a __init__ module", "n": 3}]).set_index("term")
    shown = literal_cells(frame)
    assert list(shown.index) == [escape_markdown("+ attention term 12·L·b·s²·h")] and shown.index[0].startswith("\\+")
    assert shown.loc[shown.index[0], "why"] == "a \\_\\_init\\_\\_ module" and shown.loc[shown.index[0], "n"] == 3
    assert frame.index[0] == "+ attention term 12·L·b·s²·h"  # the frame given is left as it was
