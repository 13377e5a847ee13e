"""A capture whose timed thread mostly waited (another session's Python, other processes) says so on the page,
and the compare page does not present its time difference as the configs'."""

from streamlit.testing.v1 import AppTest


def _summary_app(disturbed: bool):
    import dataclasses

    from graphviz_core.capture.result import TimeSummary
    from graphviz_core.ui.summary import show_summary
    from tests.conftest import captured

    capture = captured("gpt2-tiny")
    # 2 ms of thread CPU over 20 ms of wall: 10% (disturbed); 19 ms over 20 ms: 95% (quiet)
    cpu = 0.001 if disturbed else 0.0095
    show_summary(dataclasses.replace(capture, time=TimeSummary(0.01, 0.01, cpu, cpu)))


def _compare_app():
    import dataclasses

    from graphviz_core.analysis.compare import compare_captures
    from graphviz_core.capture.result import TimeSummary
    from graphviz_core.ui.compare_view import show_comparison
    from tests.conftest import captured

    a = captured("gpt2-tiny")
    b = dataclasses.replace(a, time=TimeSummary(0.05, 0.05, 0.01, 0.01))  # 20% of its wall time on the CPU
    show_comparison(compare_captures(a, b))


def test_a_disturbed_time_is_flagged_in_the_summary_and_a_quiet_one_is_not():
    flagged = AppTest.from_function(_summary_app, args=(True,), default_timeout=120).run()
    assert not flagged.exception
    assert any("Timing disturbed" in w.value and "10%" in w.value for w in flagged.caption)
    quiet = AppTest.from_function(_summary_app, args=(False,), default_timeout=120).run()
    assert not quiet.exception
    assert not any("Timing disturbed" in w.value for w in quiet.caption)


def test_compare_does_not_present_a_disturbed_time_difference_as_the_configs():
    at = AppTest.from_function(_compare_app, default_timeout=120).run()
    assert not at.exception
    assert any("Time difference not reliable" in w.value and "B ran for only 20%" in w.value for w in at.info)
