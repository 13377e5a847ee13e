"""Pipeline parallel combined with context parallel (torch's ring attention on every stage) and with tensor parallel's
sequence parallelism (every stage's blocks planned with SP), over the fake process group: each stage's activations per
microbatch against a hand count built from the single-stage counts of tests/test_context_sequence.py, the ring's
key/value exchange on each stage, the hidden states passed between stages."""

from __future__ import annotations

import pytest

from graphviz_core.analysis.memory_formulas import llama_layer_bytes_split
from graphviz_core.config import resolve_config
from graphviz_core.parallel.context import kv_exchange_bytes
from graphviz_core.parallel.pipeline import simulate_pipeline
from graphviz_core.parallel.settings import ParallelConfig, check_parallel

# llama-tiny (h=64, 4 query heads of 16, 2 key/value heads: kv width 32, SwiGLU I=128, V=512, s=32, float32) with 4
# layers (2 per stage) and batch 2 in 2 microbatches of 1 (1F1B over 2 pipeline ranks).
LLAMA = resolve_config("llama-tiny", layers=4, batch=2)
MB = LLAMA.replace(batch=1)  # one microbatch, for the per-layer counts


@pytest.fixture(scope="module")
def pp_cp():
    return simulate_pipeline(LLAMA, ParallelConfig("fsdp", 4, pp=2, cp=2, microbatches=2))


@pytest.fixture(scope="module")
def pp_sp():
    return simulate_pipeline(LLAMA, ParallelConfig("tp", 4, tp=2, pp=2, sequence_parallel=True, microbatches=2))


def test_pipeline_with_context_parallel_holds_s_over_c_tokens_on_every_stage(pp_cp):
    # One layer at s/C = 16 tokens of one sequence (sb = 16), as tests/test_context_sequence.py counts it (its CP 4
    # case, also sb = 16): norms 24704 + attention 12544 + SwiGLU 32768 + the ring output's copy 4096.
    layer = 24_704 + 12_544 + 32_768 + 4_096
    assert sum(llama_layer_bytes_split(MB, cp=2).values()) == layer == 74_112
    first, last = pp_cp.per_stage
    # Stage 0, per microbatch: 2 layers + the stage's output (1, 16, 64) float32 = 4096, which torch's PipelineStage
    # keeps for backward + the rotary cos and sin at this rank's 16 positions, (1, 16, 16) float32 = 1024 each.
    assert first.activation_bytes_per_microbatch == 2 * layer + 4_096 + 2 * 1_024 == 154_368
    # Stage 1: 2 layers, less the first layer's input (the received hidden states, 4096: their buffer exists before
    # the forward) + the final norm (input, normalised x, output 3 x 4096 + 1/rms 16 x 4 = 12352) + the logits and
    # log_softmax's output, (1, 16, 512) float32 = 32768 each + cos and sin 2 x 1024 + the loss and nll_loss's total
    # weight, 4 B each.
    assert last.activation_bytes_per_microbatch == 2 * layer - 4_096 + 12_352 + 2 * 32_768 + 2 * 1_024 + 8 == 224_072
    # Between stages each context rank passes its own 16 tokens: (1, 16, 64) float32 = 4096 per microbatch, 2 of them.
    assert [s.send_bytes for s in pp_cp.per_stage] == [2 * 4_096, 2 * 4_096]
    assert pp_cp.ranks[0].mesh == {"pp": 2, "dp": 1, "cp": 2, "dp_cp": 2}


def test_every_stage_runs_the_ring_and_exchanges_its_keys_and_values(pp_cp):
    # This rank's keys and values per microbatch: 2 x 1 x 16 x 32 = 1024 float32 = 4096 B (formula: context.py).
    exchange = kv_exchange_bytes(batch=1, seq=32, kv_width=32, element_bytes=4, cp=2)
    assert exchange == {"forward_bytes": 4_096, "backward_bytes": 4_096 + 2 * 4_096}
    for rank in pp_cp.ranks:  # each pipeline rank holds one stage of 2 layers and runs 2 microbatches
        ring = [c for c in rank.collectives if c.group == "cp" and c.module.endswith("self_attn")]
        forward = [(c.kind, c.buffer_bytes, c.traffic_bytes) for c in ring if c.phase == "forward"]
        backward = [(c.kind, c.buffer_bytes, c.traffic_bytes) for c in ring if c.phase == "backward"]
        # Forward, per layer and microbatch: one all-gather of both ranks' k and v (8192 B), this rank sends 4096.
        assert forward == [("all_gather", 8_192, 4_096)] * (2 * 2)
        # Backward: the same all-gather, then C = 2 all-to-all passes of the float32 k, v gradients.
        assert backward == [("all_gather", 8_192, 4_096), ("all_to_all", 4_096, 4_096), ("all_to_all", 4_096, 4_096)] * 4
        assert sum(c[2] for c in forward) == 4 * exchange["forward_bytes"]
        assert sum(c[2] for c in backward) == 4 * exchange["backward_bytes"]
        # FSDP shards the stage over data x context ranks (here 1 x 2) and reduces its gradients there.
        assert {c.kind for c in rank.collectives if c.group == "dp_cp"} >= {"all_gather", "reduce_scatter"}


def test_pipeline_with_sequence_parallel_passes_the_sequence_shard_between_stages(pp_sp):
    # One layer with TP 2 + SP at microbatch 1 (tests/test_context_sequence.py's SP count at b = 2, halved): norms on
    # 16 tokens 2 x (2 x 16*64*4 + 16*4) = 16512 + the gathered inputs of attention and MLP, whole, 2 x 32*64*4 =
    # 16384 + attention (32*64*4 + 2*32*32*4 + 32*64*4 + 4*32*4) / 2 = 12544 + SwiGLU 4*32*128*4 / 2 = 32768.
    layer = 16_512 + 16_384 + 12_544 + 32_768
    assert sum(llama_layer_bytes_split(MB, tp=2, sequence_parallel=True).values()) == layer == 78_208
    first, last = pp_sp.per_stage
    # Stage 0: 2 layers + its output on this rank's sequence shard, (1, 16, 64) float32 = 4096 + cos and sin over the
    # whole 32 positions (attention runs on the gathered sequence), (1, 32, 16) float32 = 2048 each.
    assert first.activation_bytes_per_microbatch == 2 * layer + 4_096 + 2 * 2_048 == 164_608
    # Stage 1: 2 layers less the received shard (4096, allocated before the forward) + the final norm on the shard
    # (input and normalised x 2 x 4096 + 1/rms 16 x 4 = 8256) + the head's all-gathered input (1, 32, 64) = 8192 + the
    # logits and log_softmax's output, (1, 32, 512) float32 = 65536 each + cos and sin 2 x 2048 + the loss and
    # nll_loss's total weight, 4 B each.
    assert last.activation_bytes_per_microbatch == (
        2 * layer - 4_096 + 8_256 + 8_192 + 2 * 65_536 + 2 * 2_048 + 8) == 303_944
    # Each TP rank sends its 16 tokens to the same TP rank of the next stage: 4096 per microbatch, half of plain TP's.
    assert [s.send_bytes for s in pp_sp.per_stage] == [2 * 4_096, 2 * 4_096]
    # Forward, per layer and microbatch: gather before attention, scatter after o_proj, gather before the MLP, scatter
    # after down_proj, each (1, 32, 64) float32 = 8192 B whole; the last stage gathers the head's input once more.
    for rank, extra in zip(pp_sp.ranks, ([], [("all_gather", 8_192)]), strict=True):
        forward = [(c.kind, c.buffer_bytes) for c in rank.collectives if c.phase == "forward" and c.group == "tp"]
        assert forward == ([("all_gather", 8_192), ("reduce_scatter", 8_192)] * 2 * 2 + extra) * 2
    assert pp_sp.ranks[0].mesh == {"pp": 2, "tp": 2}


def test_context_and_sequence_parallel_with_a_pipeline_and_fsdp_at_once():
    # The four dimensions together: pp 2 x dp 2 x cp 2 x tp 2 = 16 ranks, torchtitan's order; one rank per stage run.
    parallel = ParallelConfig("fsdp+tp", 16, tp=2, pp=2, cp=2, sequence_parallel=True, microbatches=2)
    report = simulate_pipeline(LLAMA, parallel, ranks=[0])
    assert report.ranks[0].mesh == {"pp": 2, "dp": 2, "cp": 2, "tp": 2, "dp_cp": 4}
    # 16 tokens per context rank, 8 per TP rank between stages: (1, 8, 64) float32 = 2048 per microbatch.
    assert report.per_stage[0].send_bytes == 2 * 2_048
    groups = {c.group for c in report.ranks[0].collectives}
    assert {"cp", "tp", "dp_cp", "pp"} <= groups


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (dict(strategy="fsdp", world_size=6, pp=2, cp=2, microbatches=2),
         "world size 6 is not divisible by pipeline 2 x context parallel 2 x TP 1"),
        (dict(strategy="tp", world_size=4, tp=2, pp=2, cp=2, microbatches=2), "pick strategy fsdp, ddp or fsdp\\+tp"),
        (dict(strategy="none", world_size=2, pp=2, sequence_parallel=True, microbatches=2),
         "set a TP degree of 2 or more"),
    ],
)
def test_layouts_left_refused_are_one_sentence(parallel, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**parallel)


def test_sequence_parallel_under_context_parallel_needs_whole_shards_of_each_context_ranks_tokens():
    # 20 tokens split over context 2 (head-tail chunks of 5: 20 is a multiple of 2 x 2) leave 10 per rank, which
    # do not split over TP 4; 24 leave 12, which do.
    parallel = ParallelConfig("fsdp+tp", 32, tp=4, pp=2, cp=2, sequence_parallel=True, microbatches=2)
    model = resolve_config("llama-tiny", heads=4, kv_heads=4, layers=4, batch=2)
    with pytest.raises(ValueError, match="splits the 10 tokens each context rank holds over TP 4; pick a sequence "
                                         "that is a multiple of 8"):
        check_parallel(model.replace(seq=20), parallel)
    check_parallel(model.replace(seq=24), parallel)
