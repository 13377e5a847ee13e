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
    for preset, overrides in [("gpt2-tiny", {}), ("mlp", {}), ("seed-block", {"batch": 1, "seq": 8})]:
        capture = captured(preset, **overrides)
        assert parameter_count_estimate(capture.config) == capture.summary.parameter_count


def test_configs_over_the_budget_are_refused_before_running(monkeypatch):
    config = config_from_preset("gpt2-small", batch=64, device="cpu")
    monkeypatch.setenv("GRAPHVIZ_CORE_CPU_BUDGET_BYTES", str(estimate_peak_bytes(config) - 1))
    with pytest.raises(CaptureError, match=r"lower batch or seq, use checkpoint 'full', or run it on device 'meta'"):
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
