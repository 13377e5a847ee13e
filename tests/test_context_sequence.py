"""Context parallel (torch's context_parallel, ring attention) and sequence parallel (torch's SequenceParallel style)
over the fake process group: one layer's activations on rank 0 against a count by hand, the ring's key/value
traffic against its formula, and a real two-process gloo run of the same ring giving the one-device loss and
gradients."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.distributed as dist

from graphviz_core.analysis.memory_formulas import korthikanti_split_layer_bytes, llama_layer_bytes_split
from graphviz_core.config import resolve_config
from graphviz_core.models.registry import build_model, compute_loss, make_batch
from graphviz_core.parallel.settings import ParallelConfig, check_parallel
from graphviz_core.parallel.simulate import simulate_parallel
from tests.gloo import gloo_group, spawn_ranks

# llama-tiny: b=2, s=32, h=64, a=4 query heads of 16, 2 key/value heads (kv width 2*16 = 32), SwiGLU I=128, V=512,
# 2 layers, float32: e = f = 4 bytes. Per layer it keeps (transformers' RMSNorm, fused sdpa, SwiGLU):
#   each norm: its input x, the normalised x and the output the projections read (3 x sb*h x 4) + 1/rms (sb x 4);
#   attention: q (sb*h), k and v (2 x sb*32), the kernel's output (sb*h) x 4, its float32 log-sum-exp (a*sb x 4);
#   SwiGLU: gate, SiLU, up and their product, 4 x sb*I x 4.
LLAMA = resolve_config("llama-tiny")


def _ring_collectives(result, phase: str) -> list:
    """The ring's transfers: collectives over the context group issued from inside an attention module."""
    return [c for c in result.collectives if c.group == "cp" and c.module.endswith("self_attn") and c.phase == phase]


def test_context_parallel_2_holds_one_layer_of_16_tokens_and_exchanges_keys_and_values():
    result = simulate_parallel(LLAMA, ParallelConfig("fsdp", 4, cp=2), single_device=False)
    layer = result.layer_activations
    # s/C = 16 tokens on this rank, sb = 2*16 = 32:
    #   norms 2 x (3*32*64*4 + 32*4) = 2 x (24576 + 128) = 49408
    #   attention q 32*64*4 = 8192 + k, v 2*32*32*4 = 8192 + output 8192 + lse 4*32*4 = 512 -> 25088
    #   SwiGLU 4*32*128*4 = 65536
    #   the ring's output is laid out (b, heads, s, d), so transformers' transpose(1, 2).contiguous() copies it for
    #   o_proj: 32*64*4 = 8192 (on one device the CPU kernel's output is already (b, s, heads, d): no copy)
    assert layer.measured_bytes == 49_408 + 25_088 + 65_536 + 8_192 == 148_224
    assert sum(layer.count_bytes.values()) == layer.measured_bytes
    assert result.mesh == {"dp": 2, "cp": 2, "dp_cp": 4}
    # Keys and values of this rank: 2 x b*(s/C)*kv = 2*2*16*32 = 2048 float32 = 8192 bytes.
    forward, backward = _ring_collectives(result, "forward"), _ring_collectives(result, "backward")
    # Forward, per layer: one all-gather of both ranks' k and v (16384 B), this rank sends its 8192.
    assert [(c.kind, c.buffer_bytes, c.traffic_bytes) for c in forward] == [("all_gather", 16_384, 8_192)] * 2
    # Backward, per layer: the same all-gather, then C = 2 all-to-all passes of the float32 k, v gradients (8192 B,
    # each sent whole to the next rank).
    per_layer = [("all_gather", 16_384, 8_192), ("all_to_all", 8_192, 8_192), ("all_to_all", 8_192, 8_192)]
    assert [(c.kind, c.buffer_bytes, c.traffic_bytes) for c in backward] == per_layer * 2
    exchange = layer.kv_exchange
    assert (exchange["formula_forward_bytes"], exchange["formula_backward_bytes"]) == (8_192, 8_192 + 2 * 8_192)
    assert (exchange["recorded_forward_bytes"], exchange["recorded_backward_bytes"]) == (8_192, 24_576)


def test_context_parallel_4_under_ddp_quarters_the_layer():
    result = simulate_parallel(LLAMA, ParallelConfig("ddp", 4, cp=4), single_device=False)
    # s/C = 8 tokens, sb = 16: norms 2 x (3*16*64*4 + 16*4) = 24704; attention 16*64*4*2 + 2*16*32*4 + 4*16*4 =
    # 8192 + 4096 + 256 = 12544; SwiGLU 4*16*128*4 = 32768; the ring output's copy 16*64*4 = 4096.
    assert result.layer_activations.measured_bytes == 24_704 + 12_544 + 32_768 + 4_096 == 74_112
    # k, v here: 2*2*8*32 = 1024 float32 = 4096 B. Forward: (C-1) x 4096 = 12288 sent; backward the same + 4 x 4096.
    exchange = result.layer_activations.kv_exchange
    assert (exchange["recorded_forward_bytes"], exchange["recorded_backward_bytes"]) == (12_288, 12_288 + 16_384)
    assert exchange["collectives_per_layer"] == 1 + 1 + 4


def test_sequence_parallel_shards_the_norms_and_keeps_the_gathered_inputs():
    plain = simulate_parallel(LLAMA, ParallelConfig("tp", 2, tp=2), single_device=False, layer_report=False)
    sp = simulate_parallel(LLAMA, ParallelConfig("tp", 2, tp=2, sequence_parallel=True), single_device=False)
    layer = sp.layer_activations
    # Whole sequence, sb = 64; attention and SwiGLU split by t = 2 either way:
    #   attention (64*64*4 + 2*64*32*4 + 64*64*4 + 4*64*4) / 2 = (16384 + 16384 + 16384 + 1024) / 2 = 25088
    #   SwiGLU 4*64*128*4 / 2 = 65536
    # Sequence parallel norms on 32 tokens: 2 x (input + normalised x (2*32*64*4) + 1/rms (32*4)) = 2 x 16512 = 33024,
    # plus the all-gathered inputs of attention and MLP, whole: 2 x 64*64*4 = 32768.
    assert layer.measured_bytes == 33_024 + 32_768 + 25_088 + 65_536 == 156_416
    assert sum(layer.count_bytes.values()) == layer.measured_bytes
    # Without sequence parallel the norms are whole: 2 x (3*64*64*4 + 64*4) = 98816 -> 189440 per layer.
    assert llama_layer_bytes_split(LLAMA, tp=2) == {
        "norms": 98_816,
        "attention": 25_088,
        "mlp": 65_536,
        "gathered_inputs": 0,
        "ring_output_copy": 0,
    }
    # Korthikanti et al., 16-bit bytes at s=32, b=2, h=64, a=4, t=2: with sequence parallel sbh/t (34 + 5as/h) =
    # 2048 x (34 + 10) = 90112; tensor parallel alone sbh (10 + 24/t + 5as/(ht)) = 4096 x 22 + 4096 x 5 = 110592.
    assert sum(layer.korthikanti_bytes.values()) == 90_112
    assert sum(korthikanti_split_layer_bytes(LLAMA, tp=2).values()) == 110_592
    assert any("all-gathered input" in note and "32,768 B" in note for note in layer.differences)
    assert any("5·a·s²·b/t = 20,480 B" in note for note in layer.differences)  # 5*4*32*32*2/2

    # Forward: TP all-reduces the attention's and MLP's outputs (2 per layer); SP all-gathers their inputs and
    # reduce-scatters their outputs instead, each 2*32*64*4 = 16384 B whole.
    def forward_collectives(result) -> list[tuple[str, int]]:
        return [(c.kind, c.buffer_bytes) for c in result.collectives if c.phase == "forward" and c.group == "tp"]

    assert forward_collectives(plain) == [("all_reduce", 16_384)] * 4  # 2 layers x (attention, MLP)
    # SP, per layer: gather before attention, scatter after o_proj, gather before the MLP, scatter after down_proj;
    # then the head's input is gathered once (the final norm ran on the shard).
    per_layer = [("all_gather", 16_384), ("reduce_scatter", 16_384)] * 2
    assert forward_collectives(sp) == per_layer * 2 + [("all_gather", 16_384)]


def test_context_and_sequence_parallel_combine_with_fsdp_and_tp_at_bf16():
    config = LLAMA.replace(dtype="bfloat16")
    result = simulate_parallel(
        config, ParallelConfig("fsdp+tp", 8, tp=2, cp=2, sequence_parallel=True), single_device=False
    )
    # 16 tokens, sb = 32, e = 2, f = 4, t = 2: norms (float32 copy of x + bf16 normalised x on 8 tokens... per
    # rank s/cp/t = 8 tokens x b) 2 x ((4+2)*32*64/2 + 4*32/2) = 2 x (6144 + 64) = 12416; gathered inputs, whole
    # 16 tokens: 2 x 2*32*64 = 8192; attention (q 2*32*64 + k, v 2*2*32*32 + output 2*32*64 + lse 4*4*32) / 2 =
    # (4096 + 4096 + 4096 + 512) / 2 = 6400; SwiGLU 4*2*32*128/2 = 16384; ring output copy 2*32*64/2 = 2048.
    assert result.layer_activations.measured_bytes == 12_416 + 8_192 + 6_400 + 16_384 + 2_048 == 45_440
    assert result.mesh == {"dp": 2, "cp": 2, "tp": 2, "dp_cp": 4}
    # This rank's key/value heads: 2 / t = 1, k and v 2*2*16*16 bf16 = 2048 B; forward sends (C-1) x 2048.
    assert result.layer_activations.kv_exchange["recorded_forward_bytes"] == 2_048


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (dict(strategy="fsdp", world_size=2, cp=3), "world size 2 is not divisible by context parallel 3"),
        (dict(strategy="tp", world_size=2, tp=2, cp=2), "pick strategy fsdp, ddp or fsdp\\+tp"),
        (dict(strategy="fsdp", world_size=2, sequence_parallel=True), "set a TP degree of 2 or more"),
    ],
)
def test_layouts_context_parallel_cannot_take_are_refused(parallel, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**parallel)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(attention="eager"), "set attention sdpa"),
        (dict(seq=30), "must be a multiple of 2 x 2 = 4"),
        # the built-in GPT-2's own reason (models/builtin.py), then the families whose attention runs as the ring
        (dict(preset="gpt2-tiny"), "numbers its learned positions itself.*Pick one of: llama, mistral, "
                                   "qwen2, mixtral, gpt2-hf, gemma3"),
    ],
)
def test_models_context_parallel_cannot_take_are_refused(fields, message):
    preset = fields.pop("preset", "llama-tiny")
    with pytest.raises(ValueError, match=message):
        check_parallel(resolve_config(preset, **fields), ParallelConfig("fsdp", 2, cp=2))


def test_cli_flags_and_json(capsys, tmp_path):
    from graphviz_core.cli import main

    out = tmp_path / "cp.json"
    assert main(["graph", "--preset", "llama-tiny", "--strategy", "fsdp", "--cp", "2", "-o", str(out)]) == 0
    per_rank = json.loads(out.read_text())["per_rank"]
    assert per_rank["parallel"]["cp"] == 2 and per_rank["parallel"]["world_size"] == 2  # world defaults to cp x tp
    assert per_rank["layer_activations"]["measured_bytes"] == per_rank["layer_activations"]["count_total_bytes"]
    assert (
        main(["graph", "--preset", "llama-tiny", "--strategy", "fsdp", "--world-size", "2", "--sequence-parallel"]) == 2
    )
    assert "set a TP degree of 2 or more" in capsys.readouterr().err


def _loss_and_grads(model, ids, targets, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = compute_loss(LLAMA, model(ids, **kwargs), targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _ring_rank(rank: int, world: int, port: int, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from graphviz_core.parallel.context import sequence_sharded

    with gloo_group(rank, world, port):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        model, batch = build_model(LLAMA), make_batch(LLAMA, "cpu")
        ids, targets = batch.inputs.clone(), batch.targets.clone()
        positions = torch.arange(ids.shape[1]).expand(ids.shape).contiguous()
        with sequence_sharded(mesh, [ids, targets, positions]):
            loss, grads = _loss_and_grads(model, ids, targets, position_ids=positions)
        # Equal tokens per rank: the mean of the ranks' losses (and gradients) is the whole sequence's.
        for t in (loss, *grads.values()):
            dist.all_reduce(t)
            t /= world
        if rank == 0:
            results.put((ids.shape[1], loss.item(), {k: v.numpy() for k, v in grads.items()}))  # by value


def test_the_cpu_ring_gives_the_one_device_loss_and_gradients_over_real_gloo_ranks():
    """Two real processes over gloo run torch's context_parallel with the CPU kernel routed into its ring."""
    local_tokens, loss, grads = spawn_ranks(_ring_rank, 2)
    batch = make_batch(LLAMA, "cpu")
    one_loss, one_grads = _loss_and_grads(build_model(LLAMA), batch.inputs, batch.targets)
    assert local_tokens == 16  # s / C = 32 / 2
    assert loss == pytest.approx(one_loss.item(), rel=1e-5)
    for name, grad in one_grads.items():
        torch.testing.assert_close(torch.from_numpy(grads[name]), grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_dry_run_in_another_thread_and_the_ring_take_turns(monkeypatch):
    """A meta dry run puts its own function in F.scaled_dot_product_attention while it runs (the fused kernel a real
    device would pick), under the name `sdpa`; torch's context_parallel, entered meanwhile, wrapped that function and
    set the wrapper under its name, F.sdpa, leaving F.scaled_dot_product_attention alone: the whole step ran plain
    attention on each rank's 16 tokens with no key/value exchange, and F.sdpa stayed behind. Now the step waits for the
    dry run to finish. (The fresh-clone failures, PP 2 x CP 2 stage 0 at 146,176 B without the ring's copies, had the
    same effect from a dry run's function left in place for good: test_capture's two dry runs at once.)"""
    import threading
    import time

    import torch.nn.functional as F
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    from graphviz_core.capture.meta_kernels import fused_attention_on_meta
    from graphviz_core.parallel import context
    from graphviz_core.parallel.context import _FORWARD

    class Asked:
        """The step's turn-taking lock, saying when the step asks for it (then it waits, the dry run holding it)."""

        def __init__(self, lock):
            self.lock, self.asked = lock, threading.Event()

        def __enter__(self):
            self.asked.set()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    turn = Asked(context.SDPA_SWAP_LOCK)
    monkeypatch.setattr(context, "SDPA_SWAP_LOCK", turn)
    entered, waited = threading.Event(), []

    def dry_run():
        with fused_attention_on_meta(cuda=False):
            entered.set()
            # until the step asks for its turn, or puts its ring in without asking (before the fix), or 10 s
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not turn.asked.is_set() and _FORWARD not in cp_attention.custom_ops:
                time.sleep(0.01)
            time.sleep(0.1)  # (a step that did not wait would be inside torch's context_parallel by now)
            waited.append(_FORWARD in cp_attention.custom_ops)  # False: the step has not put its ring in meanwhile

    thread = threading.Thread(target=dry_run)
    thread.start()
    assert entered.wait(timeout=30)
    result = simulate_parallel(LLAMA, ParallelConfig("fsdp", 4, cp=2), single_device=False, layer_report=False)
    thread.join(timeout=60)
    assert waited == [False]
    # The ring ran (test_context_parallel_2_holds_one_layer_of_16_tokens_and_exchanges_keys_and_values's forward).
    forward = _ring_collectives(result, "forward")
    assert [(c.kind, c.buffer_bytes, c.traffic_bytes) for c in forward] == [("all_gather", 16_384, 8_192)] * 2
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention and not hasattr(F, "sdpa")


def test_a_step_whose_attention_skipped_the_ring_is_an_error_not_figures():
    """Figures from a context-parallel step whose attention ran plain would be wrong everywhere (no ring output copy,
    no key/value exchange) yet look plausible: the step says so instead. Here the step calls no attention at all."""
    from graphviz_core.parallel.context import sequence_sharded
    from graphviz_core.parallel.world import fake_world, simulation_lock

    tokens = torch.arange(32).expand(2, 32).contiguous()
    with simulation_lock(), fake_world(ParallelConfig("fsdp", 2, cp=2)) as meshes:
        with pytest.raises(RuntimeError, match="did not run as torch's ring"), sequence_sharded(meshes["cp"], [tokens]):
            assert tokens.shape == (2, 16)  # this rank's two chunks of 8 tokens


def test_a_step_that_raises_inside_the_ring_leaves_no_ring_behind(monkeypatch):
    """torch 2.11's context_parallel undoes its changes after its `yield`, outside any `finally`: on an H200 box with
    torch 2.11, the ring-check test above left torch's wrapper in F.scaled_dot_product_attention, and every later
    capture in that process failed in DTensor ("does not have a sharding strategy registered"). Here torch's own
    context_parallel is entered the way 2.11's is written (clean-up skipped when the body raises), and the step that
    raises still leaves F.scaled_dot_product_attention, DTensor's handlers and the swap lock as they were."""
    import torch.distributed.tensor.experimental as experimental
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _sharding_rules

    from graphviz_core.capture.meta_kernels import SDPA_SWAP_LOCK
    from graphviz_core.parallel.context import sequence_sharded
    from graphviz_core.parallel.world import fake_world, simulation_lock

    real = experimental.context_parallel
    held = []  # 2.13's context, kept from the collector: closing it would run the `finally` 2.11 does not have

    @contextlib.contextmanager
    def as_in_torch_2_11(*args, **kwargs):
        held.append(real(*args, **kwargs))
        held[-1].__enter__()
        yield
        held.pop().__exit__(None, None, None)  # reached only when the body did not raise

    monkeypatch.setattr(experimental, "context_parallel", as_in_torch_2_11)
    sdpa, handlers = F.scaled_dot_product_attention, DTensor._op_dispatcher._custom_op_handlers
    tokens = torch.arange(32).expand(2, 32).contiguous()
    with simulation_lock(), fake_world(ParallelConfig("fsdp", 2, cp=2)) as meshes:
        with pytest.raises(RuntimeError, match="did not run as torch's ring"), sequence_sharded(meshes["cp"], [tokens]):
            assert F.scaled_dot_product_attention is not sdpa  # the ring's wrapper, while inside
    try:
        assert F.scaled_dot_product_attention is sdpa
        assert DTensor._op_dispatcher._custom_op_handlers == handlers
        assert not _sharding_rules._cp_strategy_contexts  # torch's CP sharding rules unregistered too
        assert not SDPA_SWAP_LOCK.locked()
    finally:
        while held:  # torch 2.13's own clean-up, now (it changes nothing where the step's was done)
            held.pop().__exit__(None, None, None)
        F.scaled_dot_product_attention = sdpa  # (before the fix: so the tests after this one are not failed by it)
    # a plain capture with attention afterwards runs as before
    from graphviz_core.capture.engine import capture_backward

    assert capture_backward(LLAMA).summary.nodes > 0
