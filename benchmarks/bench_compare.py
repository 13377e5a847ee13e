"""Compare mode's speed (issue 9).

Goals: two gpt2-tiny configs captured and shown <= 3 s after the click on a warm server; two Llama-3.1-70B
configs on meta compared in <= 2x one capture.

- gpt2-tiny: the compare page under AppTest (a warm server: the page ran once, so imports and torch are warm),
  then a quick pair whose two configs are not cached yet is clicked; the timed run captures both, diffs them and
  builds every element (both graphs' HTML included). Also the same work without Streamlit (core only).
- Llama-3.1-70B on meta, two pairs (sdpa vs eager attention, none vs full checkpointing): captures A and B timed
  separately in this process, the diff alone (and with the CLI's JSON), then the compare page opened on the pair's
  link with nothing cached (what a user waits for: the page starts B in the meta worker processes before it waits for
  A, graphviz_core.capture.workers, so the two run at once) and again with both cached (everything it does beyond them).
  B is the bigger capture in both pairs (eager keeps +25 nodes per layer, full checkpointing recomputes the forward
  in backward), so one after the other the compare could never be under 2x one capture of A. Like a server that has
  run a meta capture before, the worker processes are up and the page's imports done before the clock starts; the
  same page with the workers off (GRAPHVIZ_CORE_META_PROCESSES=0, one process) is timed beside it.

    python benchmarks/bench_compare.py [--repeats N] [--skip-70b]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from readme_rows import row

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "compare.py")


def page_click_s() -> tuple[float, float]:
    """Seconds of the page run after clicking 'Batch 1 vs 8' (two fresh captures), and of the first visit."""
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(PAGE, default_timeout=300)
    started = time.perf_counter()
    at.run()  # first visit: sdpa vs manual on gpt2-tiny (cold: imports, first captures)
    first = time.perf_counter() - started
    assert not at.exception, at.exception
    at.button(key="compare.pair.Batch 1 vs 8").click()
    started = time.perf_counter()
    at.run()
    took = time.perf_counter() - started
    assert not at.exception and any("does not depend on batch" in m.value for m in at.markdown)
    return took, first


def core_pair_s(a, b) -> float:
    from graphviz_core.analysis.compare import compare_captures
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.export.render import render_html

    started = time.perf_counter()
    ca, cb = capture_backward(a), capture_backward(b)
    comparison = compare_captures(ca, cb)
    render_html(ca.graph, highlight=set(comparison.only_a))
    render_html(cb.graph, highlight=set(comparison.only_b))
    return time.perf_counter() - started


def page_pair_s(params: dict[str, str]) -> tuple[float, float]:
    """Seconds of the compare page opened on a link to the pair with nothing cached (two captures, the diff,
    everything drawn), then of the same session's rerun with both captures still cached and the comparison dropped:
    the diff and every table and chart, i.e. all the page does beyond the two captures."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from graphviz_core.serve.shared_captures import shared_captures
    from graphviz_core.ui import compare_view

    shared_captures().clear()
    st.cache_resource.clear()
    at = AppTest.from_file(PAGE, default_timeout=300)
    for key, value in params.items():
        at.query_params[key] = value
    started = time.perf_counter()
    at.run()
    cold = time.perf_counter() - started
    compare_view._comparisons.clear()
    started = time.perf_counter()
    at.run()
    beyond = time.perf_counter() - started
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    assert any("What changed" in m.value for m in at.markdown)
    return cold, beyond


def llama_70b(repeats: int) -> None:
    import json

    from graphviz_core.analysis.compare import compare_captures
    from graphviz_core.capture import workers as processes
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.config import config_from_preset

    def timed(config):
        started = time.perf_counter()
        capture = capture_backward(config)
        return capture, time.perf_counter() - started

    base = config_from_preset("llama-3.1-70b")
    capture_backward(config_from_preset("llama-tiny", device="meta"))  # warm-up: transformers imports
    workers = processes.wait_for_pool(300)
    tiny = {"a.preset": "llama-tiny", "b.preset": "llama-tiny", "a.device": "meta", "b.device": "meta"}
    page_pair_s(tiny)  # warm-up: the page's imports, AppTest's first scan for components
    for label, b_config, b_param in (
        ("sdpa vs eager attention", base.replace(attention="eager", preset=""), {"b.attention": "eager"}),
        ("no checkpointing vs full", base.replace(checkpoint="full", preset=""), {"b.checkpoint": "full"}),
    ):
        params = {"a.preset": base.preset, "b.preset": base.preset, **b_param}  # the page's own link to the pair
        runs = []
        for _ in range(repeats):
            ca, ta = timed(base)
            cb, tb = timed(b_config)
            started = time.perf_counter()
            comparison = compare_captures(ca, cb)
            td = time.perf_counter() - started
            json.dumps(comparison.to_dict(), indent=1)  # what `graphviz-core compare` adds to the diff
            tc = time.perf_counter() - started
            del ca, cb, comparison
            page, beyond = page_pair_s(params)
            os.environ[processes.PROCESSES_ENV] = "0"  # the same page, every capture in this process
            try:
                alone, _ = page_pair_s(params)
            finally:
                del os.environ[processes.PROCESSES_ENV]
            runs.append((ta, tb, td, tc, beyond, page, alone))
            print(
                f"  {label}: capture A {ta:.2f} s, capture B {tb:.2f} s (B/A {tb / ta:.2f}), diff {td:.3f} s, "
                f"diff + CLI JSON {tc:.3f} s; page with nothing cached {page:.2f} s ({alone:.2f} s in one process), "
                f"rerun with both captures cached {beyond:.3f} s"
            )

        def median(f, runs=runs) -> float:
            return statistics.median(f(*r) for r in runs)

        # Ratios are taken within each run, then the median: the load on this shared machine moves every figure.
        to_a = median(lambda ta, tb, td, tc, b, page, alone: page / ta)
        alone_to_a = median(lambda ta, tb, td, tc, b, page, alone: alone / ta)
        to_two = median(lambda ta, tb, td, tc, b, page, alone: page / (ta + tb))
        b_over_a = median(lambda ta, tb, td, tc, b, page, alone: tb / ta)
        page, o = median(lambda ta, tb, td, tc, b, p, alone: p), median(lambda ta, *_: ta)
        d, c, b = (median(lambda *r, i=i: r[i]) for i in (2, 3, 4))
        how = "A and B at once in two worker processes" if workers else "no worker processes: one after the other"
        print(
            f"Llama-3.1-70B on meta, {label} (median of {repeats}): the compare page with nothing cached {page:.2f} s "
            f"= {to_a:.2f}x one capture of A ({o:.2f} s; goal <= 2x) = {to_two:.2f}x A + B captured one after the other "
            f"(B is {b_over_a:.2f}x A); {how}; the same page in one process {alone_to_a:.2f}x A. Beyond the two "
            f"captures {b:.3f} s (the diff {d:.3f} s, the CLI's diff + JSON {c:.3f} s, the rest the page's tables and "
            "charts)."
        )
        row(
            f"compare Llama-3.1-70B on meta, {label}: page with nothing cached (`bench_compare.py`)",
            f"{to_a:.2f}x one capture of A ({page:.1f} s vs {o:.1f} s; {how}; {alone_to_a:.2f}x in one process); "
            f"B alone is {b_over_a:.2f}x A; beyond the captures {b:.2f} s",
            "<= 2x",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-70b", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("GRAPHVIZ_CORE_DEVICE", "cpu")
    from graphviz_core.config import config_from_preset

    clicks = [page_click_s() for _ in range(args.repeats)]
    took, first = statistics.median(c[0] for c in clicks), statistics.median(c[1] for c in clicks)
    print(
        f"gpt2-tiny compare page: click 'Batch 1 vs 8' -> both captured and shown in {took:.2f} s "
        f"(goal <= 3 s; {took / 3:.2f} of the goal); first visit, cold, {first:.2f} s"
    )
    row("compare page, gpt2-tiny pair: click to both shown", f"{took:.2f} s", "<= 3 s")
    core = statistics.median(
        core_pair_s(config_from_preset("gpt2-tiny", seed=1 + i), config_from_preset("gpt2-tiny", attention="manual"))
        for i in range(args.repeats)
    )
    print(f"gpt2-tiny core only (two captures + diff + both graphs' HTML): {core:.2f} s")
    if not args.skip_70b:
        llama_70b(args.repeats)


if __name__ == "__main__":
    main()
