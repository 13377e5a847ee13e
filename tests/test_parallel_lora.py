"""LoRA and --freeze under the parallel simulation: frozen parameters are sharded (FSDP) or copied (DDP) like any
other, but get no gradient, no AdamW state and no share of the gradient reduce-scatter. Every figure is derived from
llama-tiny's shapes by hand, and the simulation is checked against real FSDP2 over gloo."""

from __future__ import annotations

import pytest
import torch

from graphviz_core.config import resolve_config
from graphviz_core.parallel.pipeline import simulate_layout
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.parallel.simulate import simulate_parallel
from graphviz_core.parallel.world import build_meshes
from tests.gloo import fsdp_over_gloo, gloo_group, spawn_ranks

# llama-tiny: V=512, h=64, 4 heads of 16, 2 key/value heads (k, v project to 32), MLP 128, 2 layers, untied, float32.
# Its parameters: embed_tokens 512*64 = 32768, lm_head 32768, final norm 64, and per layer q 64*64 = 4096,
# k 64*32 = 2048, v 2048, o 4096, gate 64*128 = 8192, up 8192, down 8192, two norms 128 -> 36992;
# 32768 + 32768 + 64 + 2*36992 = 139584 scalars, 21 tensors (3 + 9 per layer).
FULL = resolve_config("llama-tiny")
BASE_PARAMS = 139_584
# LoRA r=8 on q_proj and v_proj (peft: lora_A is (r, in), lora_B is (out, r)): q 8*64 + 64*8 = 1024,
# v 8*64 + 32*8 = 768 -> 1792 a layer, 3584 in the 2 layers, in 2 layers x 2 targets x (A, B) = 8 tensors.
LORA = FULL.replace(finetune="lora", lora_rank=8, lora_targets="q_proj,v_proj")
ADAPTER_PARAMS = 3_584
ADAPTER_TENSORS = 8


def test_the_adapters_are_the_only_trained_parameters_of_the_real_model():
    """The hand count above against the real peft model's requires_grad (independent of the simulation)."""
    from graphviz_core.models.registry import build_model

    model = build_model(LORA)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trained) == ADAPTER_PARAMS
    assert len(trained) == ADAPTER_TENSORS
    assert sum(p.numel() for p in model.parameters()) == BASE_PARAMS + ADAPTER_PARAMS


def test_fsdp_4_shards_every_parameter_but_grads_and_adamw_only_the_adapters():
    lora = simulate_parallel(LORA, ParallelConfig("fsdp", 4), single_device=False)
    # Every parameter, frozen included, sharded over 4: every dim 0 (512, 64, 32, 128, r=8) divides by 4, so no
    # padding: (139584 + 3584) * 4 bytes / 4 = 143168 bytes.
    assert lora.parameter_bytes == (BASE_PARAMS + ADAPTER_PARAMS) * 4 // 4 == 143_168
    # Gradients of the adapters only: 3584 * 4 / 4 = 3584 bytes.
    assert lora.gradient_bytes == ADAPTER_PARAMS * 4 // 4 == 3_584
    # AdamW: exp_avg + exp_avg_sq of each adapter shard (2 * 3584) + a float32 step per adapter tensor (8 * 4).
    assert lora.optimizer_bytes == 2 * 3_584 + 4 * ADAPTER_TENSORS == 7_200
    assert (lora.expected.gradient_bytes, lora.expected.optimizer_bytes) == (3_584, 7_200)
    scatters = [(c.parameters_of, c.buffer_bytes) for c in lora.collectives if c.kind == "reduce_scatter"]
    # One reduce-scatter per layer, of its adapters' gradients only: 1792 * 4 = 7168 bytes (a full layer would be
    # 36992 * 4 = 147968); the root (embeddings, norm, head) trains nothing and reduces nothing.
    assert scatters == [("model.layers.1", 7_168), ("model.layers.0", 7_168)]
    gathers = [c.buffer_bytes for c in lora.collectives if c.kind == "all_gather" and c.phase == "forward"]
    # Forward still gathers every (frozen) weight: root 65600 * 4 = 262400, each layer (36992 + 1792) * 4 = 155136.
    assert sorted(gathers) == [155_136, 155_136, 262_400]
    full = simulate_parallel(FULL, ParallelConfig("fsdp", 4), single_device=False)
    assert full.gradient_bytes == BASE_PARAMS * 4 // 4  # 139584 bytes: every parameter's gradient shard
    # Full fine-tuning holds 139584 bytes of gradients and 2 x 139584 + 84 of AdamW state more than LoRA's
    # 3584 + 7200: its peak is higher (the activations differ by the adapters' few (b, s, r) tensors).
    assert lora.peak_bytes < full.peak_bytes


def test_fsdp_3_pads_the_adapters_like_any_parameter():
    lora = simulate_parallel(LORA, ParallelConfig("fsdp", 3), single_device=False)
    # FSDP2 gives each rank ceil(rows / 3) rows: embed and lm_head 171*64 = 10944 each, norm 22; per layer q 22*64,
    # k 11*64, v 11*64, o 22*64, gate 43*64, up 43*64, down 22*128, norms 2*22 -> 12588; adapters q A 3*64, B 22*8,
    # v A 3*64, B 11*8 -> 648. 2*10944 + 22 + 2*(12588 + 648) = 48382 scalars = 193528 bytes.
    assert lora.parameter_bytes == 4 * 48_382 == 193_528
    assert lora.gradient_bytes == 4 * 2 * 648 == 5_184
    assert lora.optimizer_bytes == 2 * 5_184 + 4 * ADAPTER_TENSORS == 10_400
    # The closed form divides without padding: 3584 * 4 / 3 = 4778 bytes of gradients.
    assert lora.expected.gradient_bytes == 4_778


def test_freezing_the_embeddings_leaves_them_out_of_gradients_state_and_reduce_scatter():
    frozen = simulate_parallel(FULL.replace(freeze="*embed*"), ParallelConfig("fsdp", 4), single_device=False)
    assert frozen.parameter_bytes == BASE_PARAMS * 4 // 4 == 139_584  # everything still sharded over 4
    # Trained: all but embed_tokens (32768): 106816 scalars * 4 bytes / 4 ranks, in 20 of the 21 tensors.
    assert frozen.gradient_bytes == (BASE_PARAMS - 32_768) * 4 // 4 == 106_816
    assert frozen.optimizer_bytes == 2 * 106_816 + 4 * 20 == 213_712
    scatters = [(c.parameters_of, c.buffer_bytes) for c in frozen.collectives if c.kind == "reduce_scatter"]
    # Layers whole (36992 * 4 = 147968); the root without the embedding: lm_head + norm (32768 + 64) * 4 = 131328.
    # Order as FSDP2 runs it: layer 0's input (the frozen embedding's output) needs no gradient, so its post-backward
    # hook on that input never fires and its reduce-scatter waits for the root's final callback, after the root's.
    assert scatters == [("model.layers.1", 147_968), ("", 131_328), ("model.layers.0", 147_968)]


def test_lora_under_ddp_and_hsdp_reduces_only_the_adapters():
    ddp = simulate_parallel(LORA, ParallelConfig("ddp", 2), single_device=False)
    assert ddp.parameter_bytes == (BASE_PARAMS + ADAPTER_PARAMS) * 4 == 572_672  # every rank holds everything
    assert ddp.gradient_bytes == ADAPTER_PARAMS * 4 == 14_336
    # DDP (torch's replicate) all-reduces each layer's adapter gradients: 1792 * 4 = 7168 bytes.
    assert [(c.kind, c.buffer_bytes) for c in ddp.collectives if c.phase == "backward"] == [("all_reduce", 7_168)] * 2
    hsdp = simulate_parallel(LORA, ParallelConfig("hsdp", 4, shard_group=2), single_device=False)
    assert hsdp.gradient_bytes == ADAPTER_PARAMS * 4 // 2 == 7_168  # sharded over the group of 2
    reduced = sorted({(c.kind, c.buffer_bytes) for c in hsdp.collectives if c.phase == "backward" and
                      c.kind != "all_gather"})
    # Reduce-scatter of a layer's 7168 adapter bytes in its group, then all-reduce of the 3584-byte shard across.
    assert reduced == [("all_reduce", 3_584), ("reduce_scatter", 7_168)]


def test_lora_over_a_pipeline_trains_each_stages_adapters():
    report = simulate_layout(LORA, ParallelConfig("none", 2, pp=2, microbatches=2), single_device=False).pipeline
    stages = [(s.parameter_bytes, s.gradient_bytes) for s in report.per_stage]
    # Stage 0: embed 32768 + layer 0 (36992 + 1792) = 71552 scalars; stage 1: layer 1 + norm 64 + lm_head 32768
    # = 71616; each trains one layer's adapters, 1792 * 4 = 7168 bytes.
    assert stages == [(4 * 71_552, 7_168), (4 * 71_616, 7_168)]


def test_lora_under_tensor_parallelism_splits_the_adapters_as_peft_does():
    tp = simulate_parallel(LORA, ParallelConfig("tp", 2, tp=2), single_device=False)
    # Base: each layer's 7 projections (36992 - 128 norm scalars = 36864) halved, norms whole; embeddings, norm and
    # head (65600) whole: 65600 + 2 * (18432 + 128) = 102720. Adapters: A beside the column-split q and v whole
    # (8*64 = 512 each), B split by rows like them (q 32*8 = 256, v 16*8 = 128): 2 * 1408 = 2816.
    assert tp.parameter_bytes == 4 * (102_720 + 2_816) == 422_144
    assert tp.gradient_bytes == 4 * 2_816 == 11_264
    assert tp.optimizer_bytes == 2 * 11_264 + 4 * ADAPTER_TENSORS == 22_560
    adapters = [(c.kind, c.buffer_bytes) for c in tp.collectives if c.buffer_bytes != 16_384]
    # Each A's (b, s, r) = 2*32*8 float32 output gradient is a partial sum on each rank (from its half of B's rows):
    # all-reduced once in backward, 2048 bytes, 2 layers x (q, v); the (b, s, h) all-reduces of 16384 are Megatron's.
    assert adapters == [("all_reduce", 2_048)] * 4
    assert all(c.phase == "backward" for c in tp.collectives if c.buffer_bytes == 2_048)
    both = simulate_parallel(LORA, ParallelConfig("fsdp+tp", 4, tp=2), single_device=False)
    assert both.gradient_bytes == 4 * 2_816 // 2 == 5_632  # the TP shards, halved again by FSDP 2
    # Each layer reduce-scatters its adapters' TP-local gradients: 1408 * 4 = 5632 bytes.
    assert [c.buffer_bytes for c in both.collectives if c.kind == "reduce_scatter"] == [5_632, 5_632]


def test_lora_beside_a_row_split_projection_under_sequence_parallel():
    sp = simulate_parallel(LORA.replace(lora_targets="q_proj,o_proj"), ParallelConfig("tp", 2, tp=2,
                           sequence_parallel=True), single_device=False)
    # q: A whole 8*64 = 512, B halved 32*8 = 256; o (row split): A halved 8*32 = 256, B whole 64*8 = 512 -> 1536 a
    # layer, 3072 in 2 layers; the base as under TP 2 (102720).
    assert sp.parameter_bytes == 4 * (102_720 + 3_072) == 423_168
    assert sp.gradient_bytes == 4 * 3_072 == 12_288
    assert sp.optimizer_bytes == 2 * 12_288 + 4 * ADAPTER_TENSORS == 24_608
    # o's A reduce-scatters its (b, s, r) = 2*32*8 float32 output to this rank's 16 tokens (2048 bytes), as the base
    # layer does its (b, s, h) one (16384); once per layer.
    adapters = [(c.kind, c.phase) for c in sp.collectives if c.buffer_bytes == 2_048 and c.phase == "forward"]
    assert adapters == [("reduce_scatter", "forward")] * 2


def test_freeze_with_tensor_parallelism_splits_the_trained_rest():
    frozen = simulate_parallel(FULL.replace(freeze="*embed*"), ParallelConfig("tp", 2, tp=2), single_device=False)
    # TP 2 splits the 7 projections of each layer (36992 - 128 norm scalars = 36864), the rest stays whole: trained
    # = 2 * 36864 / 2 + 2 * 128 + 64 + 32768 (lm_head) = 69952 scalars = 279808 bytes; the embedding has none.
    assert frozen.gradient_bytes == 4 * 69_952 == 279_808
    assert frozen.expected.gradient_bytes == frozen.gradient_bytes


def test_frozen_norms_stay_frozen_under_sequence_parallel():
    # torch's SequenceParallel style re-registers each norm weight as a new Parameter that requires grad; the
    # simulation freezes them again. TP 2: each layer's projections (36864) halved + 2 norms (128), twice, + the
    # root's 65600 = 102720 scalars; the 5 norms (2 * 2 * 64 + 64 = 320) frozen: (102720 - 320) * 4 bytes.
    frozen = simulate_parallel(FULL.replace(freeze="*norm*"), ParallelConfig("tp", 2, tp=2, sequence_parallel=True),
                               single_device=False)
    assert frozen.gradient_bytes == 4 * (102_720 - 320) == 409_600
    assert frozen.optimizer_bytes == 2 * 409_600 + 4 * (21 - 5) == 819_264


def test_cli_fsdp_with_lora_writes_per_rank_and_takes_tp_with_sequence_parallel(tmp_path):
    import json

    from graphviz_core.cli import main

    out = tmp_path / "g.json"
    args = ["graph", "--preset", "llama-tiny", "--finetune", "lora", "--lora-targets", "q_proj,v_proj"]
    assert main([*args, "--strategy", "fsdp", "--world-size", "4", "-o", str(out)]) == 0
    per_rank = json.loads(out.read_text())["per_rank"]
    assert per_rank["gradient_bytes"] == ADAPTER_PARAMS * 4 // 4  # 3584: the adapters' quarter
    assert per_rank["single_device"]["gradient_bytes"] == ADAPTER_PARAMS * 4  # 14336 on one device
    assert per_rank["peak_bytes"] < per_rank["single_device"]["peak_bytes"]
    assert main([*args, "--strategy", "tp", "--world-size", "2", "--tp", "2", "--sequence-parallel", "-o", str(out)]) == 0
    # q and v are column-split: 2 layers x (512 + 256 + 512 + 128) adapter weights x 4 bytes per rank.
    assert json.loads(out.read_text())["per_rank"]["gradient_bytes"] == 4 * 2_816


def _comparable(result) -> dict:
    return {
        "parameter_bytes": result.parameter_bytes,
        "gradient_bytes": result.gradient_bytes,
        "optimizer_bytes": result.optimizer_bytes,
        "collectives": [(c.phase, c.kind, c.buffer_bytes, c.parameters_of) for c in result.collectives],
    }


def test_lora_simulation_matches_real_fsdp2_over_gloo():
    """Two real processes, real peft adapters, real FSDP2 over gloo: the same bytes and collectives as the fake run."""
    real = _comparable(fsdp_over_gloo(LORA, 2))
    simulated = _comparable(simulate_parallel(LORA, ParallelConfig("fsdp", 2), single_device=False))
    assert real == simulated
    assert real["gradient_bytes"] == ADAPTER_PARAMS * 4 // 2  # 7168: half of the adapters' gradients


def test_the_planner_plans_lora():
    from graphviz_core.parallel.planner import Cluster, plan

    config = LORA.replace(layers=10)  # more than the 3 and 4 layers the planner samples: its figures are scaled
    planned = plan(config, Cluster(gpus=4, gpu_memory_bytes=2**40, gpus_per_node=4), 8, checkpoints=("full",),
                   microbatch_sizes=(1,), pp_degrees=(1,), jobs=1)
    # TP 4 is refused (2 key/value heads), as with full fine-tuning.
    # With TP the planner turns sequence parallel on, as for full fine-tuning.
    assert sorted(p.layout.label() for p in planned.planned) == ["FSDP 2 x TP 2 + SP, full, microbatch 1",
                                                                 "FSDP 4, full, microbatch 1"]
    fsdp = next(p for p in planned.planned if p.layout.tp == 1)
    # 10 layers x 1792 adapter scalars x 4 bytes / 4 ranks = 17920 bytes of gradients; AdamW 2 x 17920 + 4 x 40
    # tensors (10 layers x 2 targets x A, B).
    assert fsdp.gradient_bytes == 10 * 1_792 * 4 // 4 == 17_920
    assert fsdp.optimizer_bytes == 2 * 17_920 + 4 * 40 == 36_000
    full = simulate_layout(fsdp.layout.model(config), fsdp.layout.parallel(), single_device=False)
    assert fsdp.peak_bytes == full.peak_bytes  # scaled from 3 and 4 layers = the 10-layer simulation


@pytest.mark.parametrize("args", [[], ["--strategy", "fsdp", "--world-size", "4"]], ids=["one device", "fsdp"])
def test_freezing_everything_is_a_sentence_not_a_traceback(args, capsys):
    from graphviz_core.cli import main

    assert main(["graph", "--preset", "llama-tiny", "--finetune", "lora", "--freeze", "*lora*", *args,
                 "-o", "/dev/null"]) == 2
    assert "--freeze '*lora*' leaves no parameter training" in capsys.readouterr().err


def _tp_adapter_gradients(parallel=None, meshes=None) -> dict[str, list]:
    """The adapters' gradients after one real step of llama-tiny with LoRA on every projection, whole (a DTensor's
    full_tensor), on one device or split by `parallel`. peft starts B at zero, which would leave A's gradient zero:
    the adapters get seeded values instead."""
    from graphviz_core.models.registry import build_model, compute_loss, make_batch
    from graphviz_core.parallel.simulate import apply_parallelism

    config = LORA.replace(lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    model = build_model(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    if parallel is not None:
        apply_parallelism(model, parallel, meshes, config.family.parallel)
    batch = make_batch(config, "cpu")
    compute_loss(config, model(batch.inputs), batch.targets).backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return {name: (g.full_tensor() if hasattr(g, "full_tensor") else g).tolist() for name, g in grads.items()}


def _tp_rank(rank: int, world: int, port: int, sequence_parallel: bool, results) -> None:
    with gloo_group(rank, world, port):
        parallel = ParallelConfig("tp", world, tp=world, sequence_parallel=sequence_parallel)
        grads = _tp_adapter_gradients(parallel, build_meshes(parallel))
        if rank == 0:
            results.put(grads)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_lora_under_real_tensor_parallelism_gets_one_devices_gradients(sequence_parallel):
    """Two real processes, TP 2 over gloo, the adapters split as tp_plan splits them: every adapter's gradient equals
    the one-device step's (a wrong split, a missing all-reduce, would differ by the other rank's share: with sequence
    parallel and a plain B beside o_proj and down_proj, theirs did)."""
    split = spawn_ranks(_tp_rank, 2, sequence_parallel)
    alone = _tp_adapter_gradients()
    assert len(alone) == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
    for name, grad in alone.items():
        torch.testing.assert_close(torch.tensor(split[name]), torch.tensor(grad), rtol=1e-4, atol=1e-6, msg=name)
