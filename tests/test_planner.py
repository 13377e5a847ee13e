"""The planner (graphviz_core.parallel.planner): the layouts it enumerates keep to the cluster's rules, its figures
(scaled from 3- and 4-layer runs per stage) equal full simulations of the same layouts, it ranks fitting layouts
first, and bad input gets a sentence."""

from __future__ import annotations

import dataclasses

import pytest

from graphviz_core.cli import main
from graphviz_core.config import resolve_config
from graphviz_core.parallel.pipeline import simulate_layout
from graphviz_core.parallel.planner import Cluster, layouts_of, meshes, parse_bytes, plan, ranked
from graphviz_core.parallel.settings import ParallelConfig

# llama-tiny with 10 layers: more than the 3 and 4 layers per stage the planner simulates, with or without a
# pipeline of 2 (5 layers per stage), so every figure below is scaled, none simulated whole.
LLAMA = resolve_config("llama-tiny", layers=10)
BIG = 2**40  # memory that every layout fits: none is settled without a run


@pytest.fixture(scope="module")
def small_plan():
    # 4 GPUs in one node, full checkpointing, microbatch 1, global batch 8 (a pipeline of 2 runs 4 microbatches per
    # step; FSDP 4 accumulates 2 steps of 1): FSDP 4; FSDP 2 x TP 2; FSDP 2 x PP 2; TP 2 x PP 2 (4 layouts; TP 4 is
    # refused: llama-tiny's 2 key/value heads do not split over 4 ranks).
    return plan(LLAMA, Cluster(gpus=4, gpu_memory_bytes=BIG, gpus_per_node=4), 8, checkpoints=("full",),
                microbatch_sizes=(1,), pp_degrees=(1, 2), jobs=1)


def _full(layout):
    """The busiest rank's peak and what it sends per step, from a full simulation of every layer (and every
    pipeline rank): simulate_layout's own PerRank, not the planner's figures."""
    result = simulate_layout(layout.model(LLAMA), layout.parallel(), single_device=False)
    ranks = list(result.pipeline.ranks) if result.pipeline else [result]
    peak = max(r.peak_bytes for r in ranks)
    sent = max(sum(c.traffic_bytes for c in r.collectives if c.kind not in ("send", "recv")) for r in ranks)
    return peak, sent * layout.accumulation, ranks[0]


@pytest.mark.parametrize("mesh", [
    {"dp_shard": 4, "dp_replicate": 1, "tp": 1, "pp": 1, "cp": 1},
    {"dp_shard": 2, "dp_replicate": 1, "tp": 2, "pp": 1, "cp": 1},
    {"dp_shard": 2, "dp_replicate": 1, "tp": 1, "pp": 2, "cp": 1},
])
def test_three_layouts_equal_their_full_simulations(small_plan, mesh):
    planned = next(p for p in small_plan.planned if p.layout.mesh() == mesh)
    peak, sent, first_rank = _full(planned.layout)
    assert planned.peak_bytes == peak
    assert planned.collective_bytes_per_step == sent
    if planned.layout.pp == 1:  # the busiest rank is the only one simulated: its shards too
        assert planned.parameter_bytes == first_rank.parameter_bytes  # buffers apart, as graph's per_rank has them
        assert planned.gradient_bytes == first_rank.gradient_bytes
        assert planned.optimizer_bytes == first_rank.optimizer_bytes


def test_fitting_layouts_rank_first_then_the_fastest(small_plan):
    assert len(small_plan.planned) == 4  # the 4 meshes of the fixture, one policy, one microbatch size
    assert [s["mesh"]["tp"] for s in small_plan.skipped] == [4] and "key/value heads" in small_plan.skipped[0]["reason"]
    # A GPU of the second-smallest peak: some fit, some do not.
    peaks = sorted(p.peak_bytes for p in small_plan.planned)
    memory = peaks[1]
    rerun = ranked(dataclasses.replace(p, fits=p.peak_bytes <= memory) for p in small_plan.planned)
    fits = [p.fits for p in rerun]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    speeds = [p.tokens_per_s_per_gpu for p in rerun if p.fits]
    assert speeds == sorted(speeds, reverse=True)
    assert [p.fits for p in small_plan.planned] == [True] * 4  # BIG holds every one
    data = small_plan.to_dict()
    assert {"mesh", "peak_bytes", "fits"} <= set(data["layouts"][0]) and "estimate" in data["layouts"][0]


def test_meshes_keep_tensor_parallel_inside_a_node():
    config = resolve_config("llama-tiny", layers=4)
    cluster = Cluster(gpus=16, gpus_per_node=4)
    found = meshes(config, cluster, pp_degrees=(1, 2), cp_degrees=(1, 2), cp_with_pp=True)
    for shard, replicate, tp, pp, cp in found:
        assert shard * replicate * tp * pp * cp == 16
        assert tp <= 4 and 4 % tp == 0  # tensor parallel within one node of 4
        if replicate > 1:
            assert shard <= 4 and cp == 1  # HSDP shards inside a node and replicates across nodes
    # pp 1, cp 1: tp 1, 2, 4 and HSDP 4 x 4 = 4; pp 1, cp 2: tp 1, 2, 4 = 3; pp 2, cp 1: tp 1, 2, 4 and HSDP 4 x 2
    # = 4; pp 2 x cp 2 (4 ranks left): tp 1, 2, 4 = 3: 14 in all.
    assert len(found) == 14
    assert [(tp, pp, cp) for _, _, tp, pp, cp in found if pp > 1 and cp > 1] == [(1, 2, 2), (2, 2, 2), (4, 2, 2)]
    # Without cp_with_pp (the plan's default: each such layout is a pipeline simulation) those 3 are left out.
    assert len(meshes(config, cluster, pp_degrees=(1, 2), cp_degrees=(1, 2))) == 11
    # Nodes of 2: no tp 4 even though 16 GPUs would divide into it.
    assert max(tp for _, _, tp, _, _ in meshes(config, Cluster(gpus=16, gpus_per_node=2), (1,))) == 2


def test_layouts_that_cannot_serve_the_batch_are_refused_with_a_reason():
    cluster = Cluster(gpus=8, gpus_per_node=8)
    layouts, refused = layouts_of(resolve_config("llama-tiny", layers=4), cluster, 4, ("full",), (1,), (1,))
    # Global batch 4 over FSDP 8 (8 data ranks) does not split; over FSDP 4 x TP 2, 2 x TP 4, 1 x TP 8 it does, but
    # llama-tiny's 2 key/value heads do not split over TP 4 or 8: FSDP 4 x TP 2 is left.
    assert [lay.tp for lay in layouts] == [2]
    reasons = {r["mesh"]["tp"]: r["reason"] for r in refused}
    assert sorted(reasons) == [1, 4, 8]
    assert "does not split into 8 data-parallel ranks" in reasons[1]
    assert "key/value heads are not divisible by TP degree 4" in reasons[4]


def test_memory_sizes_parse():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    with pytest.raises(ValueError, match="a memory size is a positive number and a unit"):
        parse_bytes("eighty")


@pytest.mark.parametrize("args, sentence", [
    (["--gpus", "12"], "12 GPUs do not fill whole nodes of 8; pick a multiple."),
    (["--gpus", "8", "--gpu-memory", "lots"], "a memory size is a positive number and a unit"),
    (["--gpus", "8", "--global-batch", "0"], "global batch must be a whole number from 1 to 1,048,576, got 0."),
    (["--gpus", "8", "--batch", "2"], "the plan chooses the --batch itself"),
    (["--gpus", "8", "--gpu-tflops", "0"], "--gpu-tflops takes a rate from 1e-06 to 1e+09 TFLOP/s, got 0.0."),
    (["--gpus", "8", "--pp-degrees", "two"], "--pp-degrees takes whole numbers >= 1"),
    (["--gpus", "8", "--global-batch", "3"], "the global batch 3 does not split into 8 data-parallel ranks"),
])
def test_bad_input_is_a_sentence_and_exit_2(args, sentence, capsys):
    base = ["plan", "--preset", "llama-tiny", "--global-batch", "16", "--pp-degrees", "1", "--cp-degrees", "1"]
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert sentence in err and "Traceback" not in err and len(err.strip().splitlines()) == 1



def test_tensor_parallel_layouts_run_sequence_parallel_where_the_model_takes_it(small_plan):
    tp = [p.layout for p in small_plan.planned if p.layout.tp > 1]
    assert tp and all(lay.sequence_parallel and lay.parallel().sequence_parallel for lay in tp)
    assert all("TP 2 + SP" in lay.label() for lay in tp)
    assert all(not p.layout.sequence_parallel for p in small_plan.planned if p.layout.tp == 1)
    # gpt2-tiny is no Llama-style decoder: its TP layouts stay plain tensor parallel.
    layouts, _ = layouts_of(resolve_config("gpt2-tiny"), Cluster(gpus=2, gpus_per_node=2), 2, ("full",), (1,), (1,))
    assert [(lay.tp, lay.sequence_parallel) for lay in layouts] == [(1, False), (2, False)]


def test_each_layout_request_starts_from_empty_sharding_caches():
    """DTensor caches its sharding decisions by a key whose mesh equals any later mesh of that shape made in the same
    thread (world.forget_sharding_decisions). simulate_layout empties the caches first, so a second request makes
    the same cache misses as the first (not none: every decision then came from the first request's torn-down world)."""
    import torch

    stats = getattr(torch._C, "_get_DTensor_sharding_propagator_cache_stats", None)
    if stats is None:
        pytest.skip("this torch has no C++ sharding cache to read")
    config, parallel = resolve_config("llama-tiny"), ParallelConfig(strategy="tp", world_size=2, tp=2)
    runs = []
    for _ in range(2):
        simulate_layout(config, parallel, single_device=False)
        runs.append(stats())  # (hits, misses) since the caches were emptied at the request's start
    assert runs[0][1] > 0 and runs[1] == runs[0]
