"""The CUDA paths, run for real by `make test` on a machine with a GPU; skipped, with the reason printed, elsewhere.

None of these has run yet where the project is built (no GPU there): docs/team-server.md ("What has run on a GPU")
lists what a first GPU box proves. Each capture is small enough to take seconds on any CUDA GPU.
"""

import gc
import math
import threading
import time

import pytest
import torch

from graphviz_core.capture.admission import Ticket, admission
from graphviz_core.capture.device import DEVICE_ENV, GPUS_ENV, CaptureError, cuda_devices
from graphviz_core.capture.engine import capture_backward
from graphviz_core.config import config_from_preset
from tests.conftest import captured

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine: the CUDA paths run on a GPU box (make test)"
)

MIB = 2**20


def _on_cuda(preset: str, **fields):
    """A capture on the GPU, shared by the tests that only read it."""
    return captured(preset, device="cuda", **fields)


def test_auto_picks_cuda_and_the_capture_runs_there(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)  # tests pin 'auto' to the CPU (conftest); here auto decides
    capture = capture_backward(config_from_preset("gpt2-tiny"))
    assert capture.config.device == "auto" and capture.device in cuda_devices()  # placed on one GPU, "cuda:N"
    cpu = captured("gpt2-tiny", device="cpu")
    # the graph is the model's, whatever the device: same nodes, edges and categories as the CPU capture
    assert (capture.summary.nodes, capture.summary.edges) == (cpu.summary.nodes, cpu.summary.edges)
    assert capture.summary.by_category == cpu.summary.by_category
    # CUDA's generator draws other initial weights than the CPU's; at GPT-2's init (std 0.02) the logits are near
    # zero, so the loss is near the uniform guess's ln(V) = ln(512) = 6.24
    assert abs(capture.loss - math.log(512)) < 0.5
    norms = [d["grad_norm"] for _, d in capture.graph.nodes(data=True) if d["op"] == "AccumulateGrad"]
    assert len(norms) == capture.summary.parameters and all(math.isfinite(n) and n > 0 for n in norms)
    assert capture.memory.peak_bytes is not None and capture.memory.baseline_bytes is not None


def test_the_timeline_peak_agrees_with_the_allocators_own_peak():
    torch.cuda.synchronize()
    # gpt2-small at b=4, s=256 keeps ~1.6 GiB for backward (docs/measurements.md, the same config on the CPU):
    # large against the allocator's 512-byte rounding and the kernels' workspaces
    capture = capture_backward(config_from_preset("gpt2-small", batch=4, seq=256, device="cuda"))
    # The capture reset the allocator's peak before its forward and read it once backward ended, before AdamW's step
    # (run afterwards to read its state). That step holds parameters, gradients and AdamW's two moments at once,
    # 4 x 497,759,232 bytes = 1.99 GB, more than forward and backward add above the parameters (1.23 GB on an H200):
    # the allocator's peak read now is the step's, and higher.
    step_peak = torch.cuda.max_memory_allocated()
    allocator_peak = capture.memory.peak_bytes
    assert step_peak - capture.memory.baseline_bytes >= 3 * capture.memory.parameter_bytes  # + gradients + 2 moments
    assert step_peak > allocator_peak
    timeline = capture.timeline
    # Above what was live when the run started (the allocator also counts what it held before: earlier workspaces,
    # cuBLAS's), the tracked storages and the allocator agree within 10% + 32 MiB (rounding, kernel workspaces)
    tracked = timeline.peak_bytes - timeline.steps[0].total_bytes
    allocated = allocator_peak - capture.memory.baseline_bytes
    assert tracked > 1024 * MIB
    assert abs(allocated - tracked) <= 0.10 * tracked + 32 * MIB, (allocated, tracked)
    samples = [step.allocator_bytes for step in timeline.steps[1:]]
    assert all(sample is not None for sample in samples)  # every step samples torch.cuda.memory_allocated()
    assert max(samples) <= allocator_peak


def test_node_times_come_from_cuda_events_and_fit_in_the_backward():
    capture = _on_cuda("gpt2-tiny")
    times = {node: d["time_s"] for node, d in capture.graph.nodes(data=True)}
    assert all(t is not None and t >= 0 for t in times.values())  # every node ran, and was timed
    working = [node for node, d in capture.graph.nodes(data=True) if d["flops"] > 0]
    assert working and all(times[node] > 0 for node in working)  # a node that launches a kernel takes GPU time
    # each node's interval lies inside the backward and none overlaps another (one stream, one node at a time)
    assert sum(times.values()) <= capture.time.backward_s * 1.01


def test_a_dry_run_draws_the_graph_the_gpu_runs(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)  # auto picks CUDA: meta mirrors CUDA's attention kernels
    real = _on_cuda("gpt2-tiny")
    dry = capture_backward(config_from_preset("gpt2-tiny", device="meta"))
    # float32 SDPA on CUDA is the memory-efficient kernel (ScaledDotProductEfficientAttentionBackward0), the CPU's
    # is flash-for-CPU: the dry run must show the GPU's op, and save what it saves
    assert dry.summary.by_op == real.summary.by_op
    assert not any("ForCpu" in op for op in dry.summary.by_op)
    assert dry.memory.saved_bytes == real.memory.saved_bytes


def test_the_roofline_is_measured_on_the_gpu():
    from graphviz_core.capture.device_peak import measure_peak

    peak = measure_peak("cuda")
    # a 4096 x 4096 float32 matmul and a 256 MiB copy, timed on the device
    assert (peak.device, peak.matmul_n, peak.copy_bytes) == ("cuda", 4096, 256 * MIB)
    assert math.isfinite(peak.flop_per_s) and peak.flop_per_s > 0
    assert math.isfinite(peak.bytes_per_s) and peak.bytes_per_s > 0


def test_out_of_memory_is_a_sentence_and_the_next_capture_succeeds(monkeypatch):
    good = config_from_preset("gpt2-tiny", device="cuda")
    first = capture_backward(good)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    total = torch.cuda.mem_get_info()[1]
    # Manual attention keeps each layer's scores, b x heads x s x s float32: 16 x 8192^2 x 4 B = 4 GiB per example.
    # More examples than the whole GPU holds, so the first layer's scores cannot be allocated.
    batch = total // (4 * 2**30) + 2
    huge = config_from_preset("gpt2-tiny", hidden=1024, heads=16, seq=8192, context=8192, batch=int(batch),
                              attention="manual", device="cuda")
    # admission's estimate would refuse it before it ran: let it through, so the allocator is what says no
    monkeypatch.setenv("GRAPHVIZ_CORE_CUDA_BUDGET_BYTES", str(2**62))
    monkeypatch.setenv("GRAPHVIZ_CORE_COMPUTE_BUDGET_S", str(10**9))
    ticket = Ticket()
    with pytest.raises(CaptureError) as info:
        capture_backward(huge, ticket=ticket)
    message = str(info.value)
    del info  # its traceback holds the frames of the failed run
    assert message.startswith("out of memory on cuda") and "smaller batch or seq" in message
    assert "Traceback" not in message and "\n" not in message
    gc.collect()
    assert torch.cuda.memory_allocated() <= before + MIB  # what the failed run allocated is freed
    load = admission().load(ticket.device)
    assert (load.running, load.reserved_bytes) == (0, 0)
    again = capture_backward(good)
    assert again.loss == pytest.approx(first.loss, rel=1e-6)  # same seed, same weights, same loss


def test_autocast_float16_with_a_gradient_scaler():
    fp32 = _on_cuda("gpt2-tiny")
    mixed = capture_backward(config_from_preset("gpt2-tiny", device="cuda", autocast="float16"))
    # under torch.autocast every matmul runs on float16 copies of its inputs, and saves those copies
    matmul_saves = [s for _, d in mixed.graph.nodes(data=True) if d["category"] == "matmul" for s in d["saved"]]
    assert matmul_saves and {s["dtype"] for s in matmul_saves} == {"float16"}
    # the copies are nodes of the graph: casts of the float32 weights that the float32 run does not have
    assert mixed.summary.by_op.get("ToCopyBackward0", 0) > fp32.summary.by_op.get("ToCopyBackward0", 0)
    # the weights stay float32 (master weights): same parameters, same bytes
    assert mixed.memory.parameter_bytes == fp32.memory.parameter_bytes
    # same seed, same weights: float16 changes the loss in its 3rd-4th significant digit
    assert mixed.loss == pytest.approx(fp32.loss, rel=1e-2)
    # The scaler multiplies the loss before backward so float16 gradients do not underflow; the gradients the page
    # reports are unscaled (what the optimizer steps with after scaler.unscale_): each parameter's norm within 5% of
    # the float32 run's (a scale left in would read 65,536 times larger; an underflow, 0)
    norms32 = {d["param"]["name"]: d["grad_norm"] for _, d in fp32.graph.nodes(data=True) if d["param"]}
    norms16 = {d["param"]["name"]: d["grad_norm"] for _, d in mixed.graph.nodes(data=True) if d["param"]}
    assert norms16.keys() == norms32.keys()
    for name, norm in norms32.items():
        assert norms16[name] == pytest.approx(norm, rel=0.05, abs=1e-6), name


def test_two_sessions_share_one_gpu_one_capture_at_a_time(monkeypatch):
    monkeypatch.setenv(GPUS_ENV, "0")  # one GPU allowed, however many the box has
    configs = [config_from_preset("gpt2-tiny", device="cuda", seed=seed) for seed in (1, 2)]
    alone = [capture_backward(c).loss for c in configs]
    assert alone[0] != alone[1]  # two seeds, two initialisations
    gate, building = threading.Event(), threading.Event()
    first, second = Ticket(), Ticket()
    results: dict = {}

    def session(name, config, ticket, progress=None):
        try:
            results[name] = capture_backward(config, progress=progress, ticket=ticket)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            results[name] = exc

    def hold(phase):  # the first session pauses, admitted, while its model is built
        if phase == "building the model":
            building.set()
            assert gate.wait(120)

    a = threading.Thread(target=session, args=("a", configs[0], first, hold))
    a.start()
    try:
        assert building.wait(120)
        b = threading.Thread(target=session, args=("b", configs[1], second))
        b.start()
        for _ in range(600):  # the second waits its turn: one capture at a time on a GPU
            if second.state == "waiting" and second.ahead() == 1:
                break
            time.sleep(0.05)
        assert (first.state, second.state, second.ahead()) == ("running", "waiting", 1)
    finally:
        gate.set()
        a.join(120)
    b.join(120)
    assert [results["a"].loss, results["b"].loss] == pytest.approx(alone, rel=1e-6)
    assert first.state == second.state == "done"
    load = admission().load(first.device)
    assert (load.running, load.waiting, load.reserved_bytes) == (0, 0, 0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more GPUs: one capture per GPU at once")
def test_two_sessions_run_at_once_on_two_gpus(monkeypatch):
    monkeypatch.delenv(GPUS_ENV, raising=False)
    configs = [config_from_preset("gpt2-tiny", device="cuda", seed=seed) for seed in (1, 2)]
    alone = [capture_backward(c).loss for c in configs]
    gate, building = threading.Event(), threading.Event()
    first, second = Ticket(), Ticket()
    results: dict = {}

    def hold(phase):  # the first session pauses, admitted on its GPU, while its model is built
        if phase == "building the model":
            building.set()
            assert gate.wait(120)

    def session(name, config, ticket, progress=None):
        try:
            results[name] = capture_backward(config, progress=progress, ticket=ticket)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            results[name] = exc

    a = threading.Thread(target=session, args=("a", configs[0], first, hold))
    a.start()
    try:
        assert building.wait(120)
        session("b", configs[1], second)  # not queued behind the first: another GPU is free
        assert first.state == "running" and second.state == "done"
    finally:
        gate.set()
        a.join(120)
    one, two = results["a"], results["b"]
    assert one.device == first.device and two.device == second.device and one.device != two.device
    assert {one.device, two.device} <= set(cuda_devices())
    assert [one.loss, two.loss] == pytest.approx(alone, rel=1e-6)  # same seed on another GPU, same loss
    # CUDA events on the GPU the capture ran on: every node timed, in seconds
    times = [d.get("time_s") for _, d in two.graph.nodes(data=True)]
    assert times and all(t is not None and t >= 0 for t in times)
    for device in (one.device, two.device):
        load = admission().load(device)
        assert (load.running, load.waiting, load.reserved_bytes) == (0, 0, 0)


# A real step on the GPU in a fresh process (its own caching allocator). The allocator's own history
# (torch.cuda.memory._record_memory_history: every alloc and completed free, cuBLAS's workspaces included) is
# replayed through graphviz_core.analysis.allocator, and the tensors recorded by
# graphviz_core.parallel.allocation_trace are checked against that history.
_REPLAY_A_REAL_STEP = """
import json, os, torch
from torch import nn
from graphviz_core.analysis.allocator import replay
from graphviz_core.parallel.allocation_trace import AllocationRecorder

torch.cuda.memory._record_memory_history(max_entries=1_000_000)
torch.manual_seed(0)
with AllocationRecorder(device_type="cuda") as recorder:  # AdamW's step counts stay on the CPU: not recorded
    model = nn.Sequential(nn.Linear(1024, 4096, device="cuda"), nn.GELU(), nn.Linear(4096, 1024, device="cuda"))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(2048, 1024, device="cuda")  # activations of 2048 x 4096 floats: 32 MiB
    for _ in range(2):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
torch.cuda.synchronize()
stats = torch.cuda.memory_stats()
history = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
events, key_at = [], {}
for i, entry in enumerate(history):
    if entry["action"] == "alloc":
        key_at[entry["addr"]] = i
        events.append(("alloc", i, entry["size"], str(entry["stream"])))
    elif entry["action"] == "free_completed":
        events.append(("free", key_at.pop(entry["addr"])))
expandable = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
estimate = replay(events, expandable_segments=expandable)
print(json.dumps({
    "replayed": [estimate.peak_requested_bytes, estimate.peak_allocated_bytes, estimate.peak_reserved_bytes],
    "allocator": [stats[f"{name}_bytes.all.peak"] for name in ("requested", "allocated", "reserved")],
    "recorded_sizes": [e[2] for e in recorder.trace().events if e[0] == "alloc"],
    "history_sizes": [e[2] for e in events if e[0] == "alloc"],
}))
"""


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_replaying_the_allocators_history_gives_its_reserved_peak(alloc_conf):
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf}
    run = subprocess.run(
        [sys.executable, "-c", _REPLAY_A_REAL_STEP], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    # The rules replayed over the allocator's own sequence give its peaks to the byte: requested, allocated (blocks
    # handed out, unsplit rests included) and reserved (segments, or mapped pages with expandable segments).
    assert figures["replayed"] == figures["allocator"]
    # The recorder sees the tensors' storages in the order the allocator served them: its sizes are a subsequence
    # of the allocator's (which also serves cuBLAS's workspaces and kernels' scratch buffers).
    history = iter(figures["history_sizes"])
    assert all(any(size == served for served in history) for size in figures["recorded_sizes"])
