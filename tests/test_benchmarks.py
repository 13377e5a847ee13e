"""The benchmarks' measuring code still runs: bench_families.py's child on the smallest Llama, against the library's
own figures.

`make bench` takes many minutes and `make test` does not run it, so a renamed function in the library would break a
benchmark unseen until its next run (bench_families.py's child called `transformers_for` with its old arguments).
"""

from pathlib import Path

import pytest

from tests.conftest import captured

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(autouse=True)
def benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the benchmarks import their helpers (readme_rows, steps) by name


def test_the_families_benchmark_child_captures_in_a_fresh_process():
    import bench_families

    run = bench_families.meta_run("llama-tiny")  # the child script, in a fresh interpreter, as the benchmark runs it
    capture = captured("llama-tiny")
    assert run["nodes"] == capture.summary.nodes
    assert run["parameters"] == capture.summary.parameter_count
    assert run["backward_flops"] == capture.flops.backward
    assert 0 < run["capture_s"] and 0 < run["second_capture_s"]
    from graphviz_core.config import PRESETS

    assert set(bench_families.META_GOALS) <= set(PRESETS)
