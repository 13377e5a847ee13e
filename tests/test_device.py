"""Device choice, memory budgets and out-of-memory handling (the CUDA paths run for real on a GPU box)."""

import pytest
import torch

from graphviz_core.capture.device import (
    CaptureError,
    check_budget,
    device_guard,
    estimate_peak_bytes,
    parameter_count_estimate,
    resolve_device,
)
from graphviz_core.config import config_from_preset
from tests.conftest import captured


def test_auto_honours_the_environment_override(monkeypatch):
    monkeypatch.setenv("GRAPHVIZ_CORE_DEVICE", "meta")
    assert resolve_device("auto") == "meta"
    monkeypatch.setenv("GRAPHVIZ_CORE_DEVICE", "tpu")
    with pytest.raises(CaptureError, match="GRAPHVIZ_CORE_DEVICE='tpu' is not one of cpu, cuda, meta"):
        resolve_device("auto")
    monkeypatch.delenv("GRAPHVIZ_CORE_DEVICE")
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_it_is_a_sentence():
    with pytest.raises(CaptureError, match="no usable CUDA device"):
        resolve_device("cuda")


def test_parameter_estimate_is_exact_for_the_shipped_models():
    for preset, overrides in [("gpt2-tiny", {}), ("mlp", {}), ("transformer-block", {"batch": 1, "seq": 8})]:
        capture = captured(preset, **overrides)
        assert parameter_count_estimate(capture.config) == capture.summary.parameter_count


def test_configs_over_the_budget_are_refused_before_running(monkeypatch):
    config = config_from_preset("gpt2-small", batch=64, device="cpu")
    monkeypatch.setenv("GRAPHVIZ_CORE_CPU_BUDGET_BYTES", str(estimate_peak_bytes(config) - 1))
    with pytest.raises(CaptureError, match=r"lower batch or seq, use checkpoint 'full', pick an optimizer with less state .sgd keeps none., or run it on device 'meta'"):
        check_budget(config, "cpu")
    check_budget(config, "meta")  # meta allocates nothing: never refused


@pytest.mark.parametrize(
    ("error", "device"),
    [(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), "cuda"),
     (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 999"), "cpu")],
)
def test_out_of_memory_becomes_an_actionable_error(error, device):
    if device == "cuda" and not torch.cuda.is_available():
        device = "cpu"  # the guard only empties the CUDA cache on cuda; the message is the same
    with pytest.raises(CaptureError, match=r"out of memory on .*try a smaller batch or seq, checkpoint 'full' or 'selective', or a 'meta' dry run"):
        with device_guard(device):
            raise error


def test_other_runtime_errors_are_not_swallowed():
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with device_guard("cpu"):
            raise RuntimeError("shape mismatch")


GIB = 2**30


def _cgroup(folder, limit: str, usage: int, inactive: int, version: str) -> None:
    """One fake cgroup folder: its limit, its usage and the reclaimable page cache in its memory.stat."""
    folder.mkdir(parents=True, exist_ok=True)
    names = ("memory.max", "memory.current", "inactive_file") if version == "v2" else (
        "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    (folder / names[0]).write_text(f"{limit}\n")
    (folder / names[1]).write_text(f"{usage}\n")
    (folder / "memory.stat").write_text(f"anon 4096\n{names[2]} {inactive}\nactive_file 8192\n")


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_budget_reads_this_process_own_cgroup_and_its_ancestors(tmp_path, monkeypatch, version):
    """A server in a 1.5 GiB cgroup under an unlimited mount root budgets below 1.5 GiB (the root alone read 'no
    limit', and the budget came out of the machine's free memory)."""
    from graphviz_core.capture import device

    root = tmp_path / "cgroup"
    mount = root if version == "v2" else root / "memory"
    unlimited = "max" if version == "v2" else "9223372036854771712"  # v1 writes "no limit" as 2**63 page-rounded
    _cgroup(mount, unlimited, 20 * GIB, 0, version)  # the root: the whole machine, no limit
    _cgroup(mount / "team.slice", unlimited, 6 * GIB, 0, version)
    _cgroup(mount / "team.slice" / "graphviz.scope", str(3 * GIB // 2), GIB // 2, GIB // 4, version)
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text(
        "0::/team.slice/graphviz.scope\n" if version == "v2"
        else "12:pids:/team.slice\n4:memory:/team.slice/graphviz.scope\n2:cpu,cpuacct:/team.slice\n0::/\n"
    )
    # the server as it starts: 60% of the smaller of MemAvailable (64 GiB here) and the room its own cgroup leaves,
    # 1.5 GiB limit - 0.5 GiB used + 0.25 GiB reclaimable cache = 1.25 GiB
    monkeypatch.delenv(device.CPU_BUDGET_ENV, raising=False)
    monkeypatch.setattr(device, "CGROUP_ROOT", root)
    monkeypatch.setattr(device, "PROC_SELF_CGROUP", self_cgroup, raising=False)
    monkeypatch.setattr(device, "_available_ram_bytes", lambda: 64 * GIB)
    assert device.memory_budget_bytes("cpu") == int(5 * GIB // 4 * 0.6)  # 0.75 GiB, below the 1.5 GiB limit
    assert device.container_room_bytes(root, self_cgroup) == 5 * GIB // 4
    # an ancestor's limit smaller than the room below it wins: 2 GiB - 1.5 GiB used = 0.5 GiB
    _cgroup(mount / "team.slice", str(2 * GIB), 3 * GIB // 2, 0, version)
    assert device.container_room_bytes(root, self_cgroup) == GIB // 2


def test_a_container_that_sees_its_host_cgroup_path_reads_the_mount_itself(tmp_path):
    """Docker without a cgroup namespace (v1): /proc/self/cgroup names the host's /docker/<id>, which does not exist
    under the container's mount; the mount is the container's own cgroup."""
    from graphviz_core.capture import device

    _cgroup(tmp_path / "memory", str(2 * GIB), GIB, 0, "v1")
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text("4:memory:/docker/0123abcd\n0::/\n")
    assert device.container_room_bytes(tmp_path, self_cgroup) == GIB  # 2 GiB limit - 1 GiB used
    self_cgroup.write_text("0::/\n")  # no memory controller line at all: the mount's own limit still counts
    assert device.container_room_bytes(tmp_path, self_cgroup) == GIB
    assert device.container_room_bytes(tmp_path / "no-cgroups", self_cgroup) is None


def test_the_estimate_counts_the_state_the_optimizer_builds_in_its_first_step():
    from graphviz_core.models.registry import build_model

    # 16 tokens keep gpt2-small's activations small, so the optimizer step is the larger of the two peaks
    adamw = config_from_preset("gpt2-small", batch=1, seq=16, device="cpu", optimizer="adamw")
    with torch.device("meta"):
        weights = sum(p.numel() for p in build_model(adamw).parameters())  # counted on the built model: 124,439,808
    # AdamW's step holds weights + gradients + two moments shaped like the weights, float32: 4 x P x 4 B
    assert estimate_peak_bytes(adamw) == 4 * weights * 4
    # SGD keeps no state: backward's peak (weights + gradients + activations) is the larger, above 2 x P x 4 B
    sgd = adamw.replace(optimizer="sgd")
    assert 2 * weights * 4 < estimate_peak_bytes(sgd) < 4 * weights * 4
    momentum = adamw.replace(optimizer="sgd-momentum")  # one buffer per weight: 3 x P x 4 B
    assert estimate_peak_bytes(momentum) == 3 * weights * 4
