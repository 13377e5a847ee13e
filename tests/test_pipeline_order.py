"""The pipeline's order of actions is the one each rank's runtime ran (issue 33 item 6), and a pipeline rank's backward
graph is counted, not shown as 0 nodes (item 8)."""

from __future__ import annotations

import json
import re

import pytest

from graphviz_core.cli import main
from graphviz_core.config import resolve_config
from graphviz_core.parallel.pipeline import in_turn, simulate_pipeline
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.parallel.simulate import simulate_parallel

# llama-tiny with 4 layers and a batch of 4: 4 microbatches of one sequence each.
LLAMA = resolve_config("llama-tiny", layers=4, batch=4, device="cpu")


def _each_once(order: dict[str, list[str]], microbatches: int) -> None:
    """Every stage a rank holds runs each microbatch's forward, then (later) its backward, exactly once."""
    for actions in order.values():
        runs: dict[tuple[int, str], list[int]] = {}
        for action in actions:
            stage, kind, micro = re.fullmatch(r"(\d+)([FB])(\d+)", action).groups()
            runs.setdefault((int(stage), kind), []).append(int(micro))
        for (stage, kind), micros in runs.items():
            assert sorted(micros) == list(range(microbatches)), (stage, kind, micros)
            if kind == "B":  # a backward only after its own forward
                assert all(actions.index(f"{stage}F{m}") < actions.index(f"{stage}B{m}") for m in micros)


@pytest.mark.parametrize("pp", [2, 4])
def test_the_cli_json_order_runs_each_microbatch_once_on_every_stage(tmp_path, pp):
    """Before: torch's Schedule1F1B listing gave the last rank `1F1 1B0 ... 1F4 1B3`, no 1F0 and a 1F4 with
    microbatches 0-3."""
    out = tmp_path / "pp.json"
    assert main(["graph", "--preset", "llama-tiny", "--layers", "4", "--batch", "4", "--device", "cpu",
                 "--strategy", "none", "--world-size", str(pp), "--pp", str(pp), "--microbatches", "4",
                 "--schedule", "1f1b", "-o", str(out)]) == 0
    pipeline = json.loads(out.read_text())["pipeline"]
    _each_once(pipeline["order"], 4)
    last = pipeline["order"][str(pp - 1)]
    assert last[:2] == [f"{pp - 1}F0", f"{pp - 1}B0"]  # the last stage: one forward, then its backward at once
    assert f"names {pp - 1}F1 as action 1 where the runtime ran {pp - 1}F0" in pipeline["order_note"]


def test_gpipe_and_interleaved_orders_match_torchs_listing_and_say_nothing():
    for parallel in (ParallelConfig("none", 2, pp=2, microbatches=4, schedule="gpipe"),
                     ParallelConfig("none", 2, pp=2, microbatches=4, schedule="interleaved-1f1b", stages_per_rank=2)):
        report = simulate_pipeline(LLAMA, parallel)
        _each_once({str(r): list(a) for r, a in report.order.items()}, 4)
        assert report.order_note == ""


def test_ranks_not_simulated_get_torchs_listing_numbered_as_the_runtime_runs_it():
    """The planner simulates the first and last pipeline ranks only; the others' orders (for the bubble) are torch's
    listing renumbered in turn, which is what the simulated ranks' runtimes ran."""
    parallel = ParallelConfig("none", 4, pp=4, microbatches=4, schedule="1f1b")
    whole = simulate_pipeline(LLAMA, parallel)
    part = simulate_pipeline(LLAMA, parallel, ranks=[0])
    assert part.order == whole.order
    assert in_turn(("1F1", "1B0", "1F2", "1B1")) == ("1F0", "1B0", "1F1", "1B1")


def test_a_pipeline_ranks_backward_graph_is_counted():
    """Before: per_rank.backward_nodes_by_category was {} under pipelining ("0 autograd nodes"). Two stages of
    llama-tiny (embedding + layers 0-1, layers 2-3 + norm + head), one microbatch of one sequence each: together they
    hold one device's graph of a batch of 1 less the loss's two nodes (log-softmax, NLL), which the schedule computes
    outside the stage, plus one AccumulateGrad for the hidden states stage 1 receives (a leaf that needs a gradient)."""
    report = simulate_pipeline(LLAMA, ParallelConfig("none", 2, pp=2, microbatches=4))
    one = simulate_parallel(LLAMA.replace(batch=1), ParallelConfig(), single_device=False).backward_nodes_by_category
    stage0, stage1 = (r.backward_nodes_by_category for r in report.ranks)
    assert stage0["embedding"] == 1 and "embedding" not in stage1
    assert (one["loss"], one["normalization"]) == (1, 1)
    assert sum(stage0.values()) + sum(stage1.values()) == sum(one.values()) - 2 + 1
    assert stage0["accumulate_grad"] + stage1["accumulate_grad"] == one["accumulate_grad"] + 1
