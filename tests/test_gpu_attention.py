"""The parallel simulation where `auto` picks CUDA takes attention and the softmax kernels as a CUDA GPU runs them
(graphviz_core.capture.meta_kernels.cuda_attention), checked here on the CPU by making `auto` say CUDA.

Read off an NVIDIA H200 (torch 2.11; benchmarks/gpu_sdpa_choice.py and benchmarks/gpu_step_check.py): float32
attention whose keys have fewer heads than its queries runs the math path (the memory-efficient kernel takes no
grouped heads), `_safe_softmax` holds 1 byte per element while it runs and `_softmax_backward_data` a copy of its
output. Without these a float32 Llama 3.1 8B step (2 layers, s=4096) simulated 26.07 GiB where the GPU allocated
28.61 GiB."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import graphviz_core.parallel.memory as memory
from graphviz_core.capture.meta_kernels import SDPA_SWAP_LOCK
from graphviz_core.config import resolve_config
from graphviz_core.parallel.pipeline import simulate_layout
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.parallel.simulate import measure_step, workload_of
from graphviz_core.parallel.world import fake_world, simulation_lock

# llama-tiny at 2 layers, batch 1, sequence 256: 4 query heads over 2 key/value heads (grouped), so each layer's
# attention weights are 1 x 4 x 256 x 256 = 262,144 elements, 1,048,576 B in float32.
CONFIG = resolve_config("llama-tiny", layers=2, batch=1, seq=256, device="cpu")
SCORES = 1 * 4 * 256 * 256


def _step(monkeypatch, as_cuda: bool, math: bool = False):
    """One simulated one-device step: (its figures, its allocation trace)."""
    monkeypatch.setattr(memory, "mirrors_cuda", lambda: as_cuda)
    traces = []
    parallel = ParallelConfig()
    with sdpa_kernel([SDPBackend.MATH]) if math else contextlib.nullcontext():
        with simulation_lock(), fake_world(parallel) as meshes:
            result = measure_step(workload_of(CONFIG), parallel, meshes, config=CONFIG, on_allocations=traces.append)
    return result, traces[0]


def _workspaces(trace) -> list[int]:
    """Sizes of the allocations freed as soon as the next one is made (a kernel's workspace beside its output)."""
    events = trace.events
    return [e[2] for i, e in enumerate(events[:-2]) if e[0] == "alloc" and events[i + 2] == ("free", e[1])]


def test_grouped_float32_attention_is_the_math_path_where_auto_picks_cuda(monkeypatch):
    """The forward's activations equal a step whose SDPA torch itself sends down the math path (so the routing is the
    math path, no more and no less), and differ from this CPU's fused kernel's: the weights kept are the difference."""
    gpu, _ = _step(monkeypatch, as_cuda=True)
    math, _ = _step(monkeypatch, as_cuda=False, math=True)
    cpu, _ = _step(monkeypatch, as_cuda=False)
    assert gpu.forward_end_activation_bytes == math.forward_end_activation_bytes
    # each layer keeps its float32 attention weights (4 B x SCORES) where the fused kernel keeps a log-sum-exp
    assert gpu.forward_end_activation_bytes - cpu.forward_end_activation_bytes >= 2 * 4 * SCORES
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention and not SDPA_SWAP_LOCK.locked()
    # each says, once, which kernel it ran
    assert [n for n in gpu.notes if "Attention ran" in n][0].startswith("Attention ran as a CUDA GPU runs it")
    assert [n for n in cpu.notes if "Attention ran" in n][0].startswith("Attention ran this machine's fused kernel")
    assert sum("Attention ran" in n for n in gpu.notes) == sum("Attention ran" in n for n in cpu.notes) == 1


def test_attention_is_left_alone_without_grouped_heads(monkeypatch):
    """gpt2-tiny's heads are not grouped: float32 attention on CUDA is the memory-efficient kernel, whose saved set
    this CPU's fused kernel matches, so the step is the same either way and no note is added."""
    monkeypatch.setattr(memory, "mirrors_cuda", lambda: True)
    tiny = resolve_config("gpt2-tiny", device="cpu")
    gpu = simulate_layout(tiny, ParallelConfig(), single_device=False)
    monkeypatch.setattr(memory, "mirrors_cuda", lambda: False)
    cpu = simulate_layout(tiny, ParallelConfig(), single_device=False)
    assert gpu.peak_bytes == cpu.peak_bytes and gpu.forward_end_activation_bytes == cpu.forward_end_activation_bytes
    assert not [n for n in gpu.notes + cpu.notes if "Attention ran" in n]


def test_the_gpus_softmax_workspaces_are_allocated_and_freed_in_the_step(monkeypatch):
    """Per layer (no checkpointing): the forward's _safe_softmax holds 1 B x SCORES = 262,144 B and the backward's
    _softmax_backward_data a float32 copy of its output, 4 B x SCORES = 1,048,576 B; the peak rises by no more than
    the largest of them over the same step without them (torch's math path on this CPU)."""
    gpu, trace = _step(monkeypatch, as_cuda=True)
    math, math_trace = _step(monkeypatch, as_cuda=False, math=True)
    # beyond the short-lived allocations the math path makes itself (its own scores' temporaries), exactly these
    extra = Counter(_workspaces(trace)) - Counter(_workspaces(math_trace))
    assert sorted(extra.elements()) == [SCORES, SCORES, 4 * SCORES, 4 * SCORES]
    assert math.peak_bytes <= gpu.peak_bytes <= math.peak_bytes + 4 * SCORES


def test_a_pipelines_rank_threads_share_the_gpus_attention_and_leave_torchs_in_place(monkeypatch):
    """Pipeline ranks are simulated in threads, each entering the routing: the first in swaps the function, the last
    out puts torch's back (before, holding the swap lock per thread, the second rank waited on the first for good)."""
    monkeypatch.setattr(memory, "mirrors_cuda", lambda: True)
    config = CONFIG.replace(seq=64, batch=2)
    gpu = simulate_layout(config, ParallelConfig("fsdp", 4, pp=2, microbatches=2), single_device=False)
    monkeypatch.setattr(memory, "mirrors_cuda", lambda: False)
    cpu = simulate_layout(config, ParallelConfig("fsdp", 4, pp=2, microbatches=2), single_device=False)
    assert gpu.pipeline.per_stage[0].activation_bytes_per_microbatch > cpu.pipeline.per_stage[0].activation_bytes_per_microbatch
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention and not SDPA_SWAP_LOCK.locked()
