"""Per-rank memory and collectives under FSDP2 / TP over torch's fake process group, checked by hand arithmetic
and against a real multi-process gloo run."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from graphviz_core.config import resolve_config
from graphviz_core.parallel.settings import ParallelConfig, check_parallel
from graphviz_core.parallel.simulate import simulate_parallel
from tests.gloo import fsdp_over_gloo

# gpt2-tiny: V=512, h=64, 2 layers, seq 32, float32, tied wte / lm_head.
TINY = resolve_config("gpt2-tiny")
# Its parameters: wte 512*64 = 32768 (lm_head shares it), wpe 32*64 = 2048, ln_f 2*64 = 128, and per block
# ln_1 + ln_2 4*64 = 256, qkv 64*192 + 192 = 12480, proj 64*64 + 64 = 4160, fc 64*256 + 256 = 16640,
# mlp.proj 256*64 + 64 = 16448 -> 49984 per block; 32768 + 2048 + 128 + 2*49984 = 134912 scalars.
TINY_PARAMS = 134_912
TINY_BYTES = 4 * TINY_PARAMS  # 539648 bytes in float32
# Tensors: wte, wpe, ln_f weight + bias, and per block ln_1, qkv, proj, ln_2, fc, mlp.proj weight + bias (12).
TINY_TENSORS = 2 + 2 + 2 * 12


def test_fsdp_over_4_ranks_holds_a_quarter_of_everything():
    result = simulate_parallel(TINY, ParallelConfig("fsdp", 4), single_device=False)
    assert result.parameter_count == TINY_PARAMS
    # Every dim 0 here (512, 32, 64, 192, 256) divides by 4: no padding. 539648 / 4 = 134912 bytes.
    assert result.parameter_bytes == TINY_BYTES // 4 == 134_912
    assert result.gradient_bytes == 134_912
    # AdamW: exp_avg + exp_avg_sq of every shard (2 * 134912) + a float32 `step` per tensor (28 * 4 = 112).
    assert TINY_TENSORS == 28
    assert result.optimizer_bytes == 2 * 134_912 + 4 * 28 == 269_936
    assert result.expected.parameter_bytes == result.parameter_bytes
    assert result.expected.optimizer_bytes == result.optimizer_bytes


def test_fsdp_over_3_ranks_pads_dim_0_up_to_a_multiple_of_3():
    result = simulate_parallel(TINY, ParallelConfig("fsdp", 3), single_device=False)
    # FSDP2 gives each rank ceil(rows / 3) rows of every parameter (the last rank's are padding):
    # wte 171*64 = 10944, wpe 11*64 = 704, ln_f 2*22 = 44; per block ln_1 + ln_2 4*22 = 88,
    # qkv 64*64 + 64 = 4160, proj 22*64 + 22 = 1430, fc 86*64 + 86 = 5590, mlp.proj 22*256 + 22 = 5654
    # -> 16922 per block; 10944 + 704 + 44 + 2*16922 = 45536 scalars = 182144 bytes.
    assert result.parameter_bytes == 4 * 45_536 == 182_144
    # The unpadded third, 539648 / 3 = 179882 bytes, is what the closed form says; padding is the gap.
    assert result.expected.parameter_bytes == 179_882
    assert result.gradient_bytes == 182_144


def test_tensor_parallel_splits_projections_and_keeps_the_rest_whole():
    result = simulate_parallel(TINY, ParallelConfig("tp", 2, tp=2), single_device=False)
    # Split per block: qkv weight + bias 12480, proj weight 4096, fc weight + bias 16640, mlp.proj weight
    # 16384 -> 49600; halved on each rank. Whole: embeddings, norms and the row-split biases (64 + 64).
    split = 2 * 49_600
    assert result.parameter_bytes == 4 * (split // 2 + (TINY_PARAMS - split)) == 341_248
    # Megatron: one all-reduce of the (B, T, h) = 2*32*64*4 = 16384-byte activation per attention and per
    # MLP, forward (after the row-split matmul) and backward (the gradient of the column-split input).
    backward = [c for c in result.collectives if c.phase == "backward"]
    assert [(c.kind, c.buffer_bytes) for c in backward] == [("all_reduce", 16_384)] * 4
    assert {c.autograd_node for c in backward} == {"_FromTorchTensorBackward"}
    assert [c.module for c in backward] == ["blocks.1.mlp", "blocks.1.attn", "blocks.0.mlp", "blocks.0.attn"]
    assert all(c.issued_by == "autograd node" for c in backward)
    # Rank 0's autograd graph holds DTensor's conversions as `communication` nodes, 12 per block: from_local
    # of the attention and MLP inputs (the two whose backward all-reduces) and of the row-split inputs (proj,
    # mlp.proj) = 4; to_local of the four projections' outputs = 4; redistribute of the two column-split inputs
    # (already replicated) and of the two row-split outputs (partial -> replicated, forward's all-reduce) = 4.
    assert result.backward_nodes_by_category["communication"] == 2 * (4 + 4 + 4)


def test_fsdp_backward_reduce_scatters_each_layer_from_its_hook():
    result = simulate_parallel(TINY, ParallelConfig("fsdp", 4), single_device=False)
    scatters = [c for c in result.collectives if c.kind == "reduce_scatter"]
    # One per FSDP unit, last layer first: 49984 * 4 = 199936 bytes per block, root 34944 * 4 = 139776.
    assert [(c.parameters_of, c.buffer_bytes) for c in scatters] == [
        ("blocks.1", 199_936),
        ("blocks.0", 199_936),
        ("", 139_776),
    ]
    assert all(c.issued_by == "hook" and c.phase == "backward" for c in scatters)
    # Ring reduce-scatter over 4 ranks sends 3/4 of the buffer: 199936 * 3 / 4 = 149952 bytes.
    assert scatters[0].traffic_bytes == 149_952
    assert scatters[0].link == "NVLink"  # 4 ranks fit in one 8-GPU node


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (dict(strategy="tp", world_size=3, tp=3), "4 attention heads are not divisible by TP degree 3"),
        (dict(strategy="fsdp+tp", world_size=6, tp=4), "world size 6 is not divisible by TP degree 4"),
        (dict(strategy="fsdp", world_size=4, tp=2), "strategy 'fsdp' has no tensor parallelism"),
        (dict(strategy="hsdp", world_size=8, shard_group=3), "HSDP shards inside groups of ranks"),
        (dict(strategy="none", world_size=2), "strategy 'none' runs on one device"),
        (dict(strategy="ddp", world_size=2, mixed_precision="bf16"), None),
    ],
)
def test_invalid_layouts_are_refused_with_one_sentence(parallel, message):
    if message is None:  # a valid layout: constructing it must not raise
        check_parallel(TINY, ParallelConfig(**parallel))
        return
    with pytest.raises(ValueError, match=message):
        check_parallel(TINY, ParallelConfig(**parallel))


def test_mixed_precision_needs_float32_master_weights():
    with pytest.raises(ValueError, match="set dtype float32"):
        check_parallel(TINY.replace(dtype="bfloat16"), ParallelConfig("fsdp", 2, mixed_precision="bf16"))


def test_the_fake_process_group_is_gone_after_a_simulation():
    simulate_parallel(TINY, ParallelConfig("fsdp", 2), single_device=False)
    assert not dist.is_initialized()


def _comparable(result) -> dict:
    return {
        "parameter_bytes": result.parameter_bytes,
        "gradient_bytes": result.gradient_bytes,
        "optimizer_bytes": result.optimizer_bytes,
        "phases": {p.phase: p.parts_bytes for p in result.phases},
        "collectives": [
            (c.phase, c.kind, c.buffer_bytes, c.group, c.module, c.parameters_of) for c in result.collectives
        ],
    }


@pytest.mark.parametrize(
    "world",
    [
        2,
        # Four real processes take ~50 s on this 2-core machine (imports dominate); opt in.
        pytest.param(
            4, marks=pytest.mark.skipif(not os.environ.get("GRAPHVIZ_CORE_GLOO_4"), reason="set GRAPHVIZ_CORE_GLOO_4=1")
        ),
    ],
)
def test_simulation_matches_a_real_gloo_run(world):
    """Real processes, real FSDP2 over gloo: the same per-rank bytes and the same collectives as the fake run."""
    real = _comparable(fsdp_over_gloo(TINY, world))
    simulated = _comparable(simulate_parallel(TINY, ParallelConfig("fsdp", world), single_device=False))
    assert real["parameter_bytes"] == simulated["parameter_bytes"] == TINY_BYTES // world
    assert real["gradient_bytes"] == simulated["gradient_bytes"]
    assert real["optimizer_bytes"] == simulated["optimizer_bytes"]
    assert real["collectives"] == simulated["collectives"]
    assert real["phases"]["forward"] == simulated["phases"]["forward"]
    # gloo lets go of a collective's buffer on its own thread, after the caller's wait has returned: on a loaded run
    # the last reduce-scatter's buffer (the root's: wte, wpe and ln_f, 139,776 bytes at world 2) was still alive
    # during the optimizer step, as a temporary. Every other part must match, and temporaries up to that buffer.
    last_reduce_scatter = [c for c in simulated["collectives"] if c[1] == "reduce_scatter"][-1][2]
    real_optimizer, simulated_optimizer = dict(real["phases"]["optimizer"]), dict(simulated["phases"]["optimizer"])
    lag = real_optimizer.pop("temporaries") - simulated_optimizer.pop("temporaries")
    assert real_optimizer == simulated_optimizer
    assert lag in (0, last_reduce_scatter), lag
    # gloo runs each reduce-scatter on its own thread, so which gradients, temporaries and buffers exist at the
    # instant the backward peaks depends on the machine's load (seen: one layer's sharded gradient, 99968
    # bytes, present in the real run and not yet in the simulation). What rank 0 holds regardless must match.
    timing_free = ("parameters", "gathered_parameters", "optimizer")
    for part in timing_free:
        assert real["phases"]["backward"][part] == simulated["phases"]["backward"][part], part


def test_cli_json_gains_per_rank_and_bad_layouts_exit_2(tmp_path, capsys):
    import json

    from graphviz_core.cli import main

    out = tmp_path / "g.json"
    assert main(["graph", "--preset", "gpt2-tiny", "--strategy", "fsdp", "--world-size", "4", "-o", str(out)]) == 0
    per_rank = json.loads(out.read_text())["per_rank"]
    assert per_rank["parameter_bytes"] == TINY_BYTES // 4  # 539648 / 4 = 134912
    assert per_rank["optimizer_bytes"] == 2 * 134_912 + 4 * 28
    assert per_rank["single_device"]["parameter_bytes"] == TINY_BYTES
    kinds = [(c["kind"], c["bytes"]) for c in per_rank["collectives"] if c["phase"] == "backward"]
    assert ("reduce_scatter", 199_936) in kinds  # one block: 49984 float32 = 199936 bytes
    assert per_rank["peak_bytes"] == max(p["peak_bytes"] for p in per_rank["phases"].values())
    assert main(["graph", "--preset", "gpt2-tiny", "--strategy", "tp", "--tp", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "graphviz-core: 4 attention heads are not divisible by TP degree 3; each rank needs whole heads."
    )


def test_bf16_mixed_precision_gathers_half_the_bytes_of_the_float32_shards():
    result = simulate_parallel(TINY, ParallelConfig("fsdp", 4, mixed_precision="bf16"), single_device=False)
    # The sharded (master) parameters stay float32: 539648 / 4 = 134912 bytes, as without mixed precision.
    assert result.parameter_bytes == 134_912
    # The all-gather moves bfloat16: one block's 49984 parameters * 2 bytes = 99968 bytes (float32: 199936).
    gathers = [c for c in result.collectives if c.kind == "all_gather" and c.parameters_of == "blocks.0"]
    assert {c.buffer_bytes for c in gathers} == {99_968}
    # bf16 reduction: the reduce-scatter is bfloat16 too; bf16-fp32-reduce would make it float32.
    scatters = [c for c in result.collectives if c.kind == "reduce_scatter" and c.parameters_of == "blocks.0"]
    assert [c.buffer_bytes for c in scatters] == [99_968]


def test_without_resharding_backward_gathers_nothing():
    kept = simulate_parallel(TINY, ParallelConfig("fsdp", 4, reshard_after_forward=False), single_device=False)
    # Parameters gathered in forward stay until backward: no backward all-gathers, three reduce-scatters.
    backward = [c.kind for c in kept.collectives if c.phase == "backward"]
    assert backward == ["reduce_scatter"] * 3
    resharded = simulate_parallel(TINY, ParallelConfig("fsdp", 4), single_device=False)
    # Resharded layers are gathered again in backward, one per block; the root is not (FSDP2's default).
    assert [c.kind for c in resharded.collectives if c.phase == "backward"].count("all_gather") == 2
    # The price: every block's gathered parameters are live at once. Two blocks + root = 539648 bytes gathered.
    assert kept.phase("forward").parts_bytes["gathered_parameters"] == TINY_BYTES


def test_a_capture_in_another_thread_does_not_leak_into_the_simulation():
    """The server runs captures for other sessions while a simulation runs; torch's module trackers hook every
    module in the process, so the simulation must ignore modules running in other threads."""
    import threading

    from graphviz_core.capture.engine import capture_backward

    alone = simulate_parallel(TINY, ParallelConfig("fsdp", 4), single_device=False)
    stop, captured, errors = threading.Event(), [], []

    def capture_until_stopped():
        while not stop.is_set():
            try:
                captured.append(capture_backward(TINY.replace(device="cpu")).summary.nodes)
            except Exception as exc:  # noqa: BLE001 - the assertion below reports it
                errors.append(exc)
                return

    worker = threading.Thread(target=capture_until_stopped)
    worker.start()
    try:
        busy = simulate_parallel(TINY, ParallelConfig("fsdp", 4), single_device=False)
    finally:
        stop.set()
        worker.join()
    assert not errors and captured
    assert len(set(captured)) == 1  # every concurrent capture saw the same graph
    assert [p.parts_bytes for p in busy.phases] == [p.parts_bytes for p in alone.phases]
    assert busy.collectives == alone.collectives


def _collectives_of_a_training_script(world: int) -> list[tuple[str, str, str | None, int]]:
    """gpt2-tiny wrapped as torchtitan's apply_fsdp wraps a model, written out here without the simulation's code:
    fully_shard on each block, then fully_shard(model) with no reshard_after_forward; one forward and backward on
    fake tensors over the fake process group, every collective recorded."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from graphviz_core.models.registry import build_model, compute_loss
    from graphviz_core.parallel.collectives import CollectiveRecorder

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        with torch.device("meta"):
            model = build_model(TINY)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        recorder = CollectiveRecorder({mesh.get_group(0).group_name: "dp"})
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            model.lm_head.weight = model.wte.weight  # to_empty splits the tie; the real model holds one tensor
            tokens = torch.zeros(TINY.batch, TINY.seq, dtype=torch.long)
            with recorder:
                loss = compute_loss(TINY, model(tokens), tokens)
                recorder.phase = "backward"
                loss.backward()
        return [(c.phase, c.kind, c.parameters_of, c.buffer_bytes) for c in recorder.collectives]
    finally:
        dist.destroy_process_group()


def test_the_root_stays_gathered_after_forward_as_fsdp2_leaves_it_by_default():
    """The root (wte, tied with lm_head, wpe, ln_f) is wrapped as training scripts wrap it: FSDP2's default keeps it
    unsharded after forward, so backward gathers the two blocks again and not the root."""
    result = simulate_parallel(TINY, ParallelConfig("fsdp", 4), single_device=False)
    assert result.resharded_after_forward == {"": False, "blocks.0": True, "blocks.1": True}
    assert result.to_dict()["resharded_after_forward"]["root"] is False
    gathers = [(c.phase, c.parameters_of) for c in result.collectives if c.kind == "all_gather"]
    # Forward gathers the root and both blocks; backward only the blocks, the last one first.
    assert gathers == [("forward", ""), ("forward", "blocks.0"), ("forward", "blocks.1"),
                       ("backward", "blocks.1"), ("backward", "blocks.0")]
    # Counted from the units: 3 forward all-gathers + 2 backward + 3 reduce-scatters (one per unit) = 8.
    assert len(result.collectives) == 3 + 2 + 3
    # The root's 34944 scalars (wte 32768 + wpe 2048 + ln_f 128) stay gathered through backward: 139776 bytes,
    # beside one block's 49984 * 4 = 199936 at the backward peak.
    assert result.phase("backward").parts_bytes["gathered_parameters"] == 4 * 34_944 + 4 * 49_984 == 339_712
    # The same collectives as the model wrapped with torch's defaults directly, as a training script does.
    script = _collectives_of_a_training_script(4)
    simulated = [(c.phase, c.kind, c.parameters_of, c.buffer_bytes) for c in result.collectives
                 if c.phase != "optimizer"]
    assert simulated == script


def test_a_float32_mixture_of_experts_runs_under_fsdp():
    """Mixtral's expert GEMMs (`_grouped_mm`): the CPU kernel runs float32, the fake kernel refused it, so any
    parallel layout of a float32 Mixtral stopped with a traceback."""
    from graphviz_core.models.registry import build_model
    from tests.conftest import captured

    config = resolve_config("mixtral-tiny")
    assert config.dtype == "float32"
    with torch.device("meta"):
        model = build_model(config)
    # FSDP2 shards each parameter on dim 0, padded up to a multiple of the 2 ranks: ceil(rows / 2) rows each
    shard = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * 4 for p in model.parameters())
    rank = simulate_parallel(config, ParallelConfig("fsdp", 2), single_device=False)
    assert rank.parameter_bytes == rank.gradient_bytes == shard
    # each rank runs the whole local batch: the same FLOPs as the one-device capture (counted on real tensors)
    alone = captured("mixtral-tiny")
    assert rank.flops_by_phase["forward"] == alone.flops.forward
    assert rank.flops_by_phase["backward"] == alone.flops.backward
