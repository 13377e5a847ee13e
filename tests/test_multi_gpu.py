"""Placing CUDA captures on a box with several GPUs, on a simulated device list (this runs on the CPU: torch.cuda's
is_available, device_count and mem_get_info are replaced; admission places and queues, nothing runs on a GPU).
tests/test_cuda.py holds the check a real box with two or more GPUs runs."""

import threading
import time

import pytest
import torch

from graphviz_core.capture.admission import Admission, CaptureCancelled, Ticket
from graphviz_core.capture.device import (
    CUDA_BUDGET_ENV,
    GPUS_ENV,
    CaptureError,
    cuda_devices,
    estimate_peak_bytes,
    memory_budget_bytes,
)
from graphviz_core.config import config_from_preset

GIB = 2**30
TINY = config_from_preset("gpt2-tiny", device="cuda")
# Free memory of each simulated GPU: the budget is 90% of it (memory_budget_bytes), so the most room is GPU 1's.
FREE = {0: 4 * GIB, 1: 12 * GIB, 2: 8 * GIB}


@pytest.fixture
def gpus(monkeypatch):
    """Three simulated GPUs with FREE's free memory; every GPU allowed unless a test sets GRAPHVIZ_CORE_GPUS."""
    asked: list = []

    def mem_get_info(device=None):
        asked.append(device)
        return FREE[device], 80 * GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(FREE))
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.delenv(CUDA_BUDGET_ENV, raising=False)
    monkeypatch.delenv(GPUS_ENV, raising=False)
    monkeypatch.setenv("GRAPHVIZ_CORE_QUEUE_TIMEOUT_S", "5")  # a capture serialised by mistake fails, not hangs
    return asked


def test_a_capture_goes_to_the_gpu_with_the_most_room(gpus):
    admission = Admission()
    with admission.admit(TINY, "cuda") as ticket:
        assert ticket.device == "cuda:1"  # 12 GiB free, against 4 and 8
        load = admission.load("cuda:1")
        # its budget is that GPU's own: 90% of its 12 GiB free (memory_budget_bytes' share on CUDA)
        assert load.budget_bytes == int(12 * GIB * 0.9)
        assert (load.running, load.reserved_bytes) == (1, estimate_peak_bytes(TINY))
        assert admission.load("cuda:2").budget_bytes == int(8 * GIB * 0.9)
    assert {0, 1, 2} <= set(gpus)  # each GPU's free memory was asked for by its own index
    assert admission.load("cuda:1").reserved_bytes == 0


def test_two_captures_at_once_run_on_two_gpus(gpus):
    admission = Admission()
    with admission.admit(TINY, "cuda") as first, admission.admit(TINY, "cuda") as second:
        # the second did not wait for the first: it went to the free GPU with the most room left (8 GiB, not 4)
        assert (first.device, second.device) == ("cuda:1", "cuda:2")
        assert first.state == second.state == "running"
        assert admission.load("cuda:1").running == admission.load("cuda:2").running == 1


def test_each_gpu_queues_its_own_captures(gpus, monkeypatch):
    monkeypatch.setenv(GPUS_ENV, "1,2")
    admission = Admission()
    third = Ticket()
    with admission.admit(TINY, "cuda") as first, admission.admit(TINY, "cuda") as second:
        box: dict = {}

        def later():
            with admission.admit(TINY, "cuda", third):
                box["ran_on"] = third.device

        thread = threading.Thread(target=later)
        thread.start()
        deadline = time.monotonic() + 30
        while third.state != "waiting":
            assert time.monotonic() < deadline, "the third capture never queued"
            time.sleep(0.01)
        # both allowed GPUs run one capture: the third waits on the one with more room left, GPU 1, behind 1
        assert (first.device, second.device, third.device, third.ahead()) == ("cuda:1", "cuda:2", "cuda:1", 1)
        assert admission.load("cuda:1").waiting == 1 and admission.load("cuda:2").waiting == 0
    thread.join(30)
    assert box["ran_on"] == "cuda:1" and third.state == "done"


def test_a_busy_gpu_is_waited_for_when_the_idle_one_is_too_small(gpus, monkeypatch):
    need = estimate_peak_bytes(TINY)
    # GPU 0's budget (90% of its free memory) is a byte short of the estimate; GPU 1 holds it
    monkeypatch.setitem(FREE, 0, int((need - 1) / 0.9))
    monkeypatch.setenv(GPUS_ENV, "0,1")
    admission = Admission()
    waiting = Ticket()
    box: dict = {}

    def later():
        with pytest.raises(CaptureCancelled) as info, admission.admit(TINY, "cuda", waiting):
            pass
        box["raised"] = info.value

    with admission.admit(TINY, "cuda") as first:
        thread = threading.Thread(target=later)
        thread.start()
        deadline = time.monotonic() + 30
        while waiting.state != "waiting":
            assert time.monotonic() < deadline, "the second capture never queued"
            time.sleep(0.01)
        assert first.device == "cuda:1" and waiting.device == "cuda:1" and waiting.ahead() == 1
        waiting.cancel()
        thread.join(30)
    assert isinstance(box["raised"], CaptureCancelled) and waiting.state == "cancelled"
    assert admission.load("cuda:0").running == 0


def test_graphviz_core_gpus_limits_the_choice(gpus, monkeypatch):
    monkeypatch.setenv(GPUS_ENV, "0")
    with Admission().admit(TINY, "cuda") as ticket:
        assert ticket.device == "cuda:0"  # the only one allowed, though GPU 1 has three times its room
    monkeypatch.setenv(GPUS_ENV, " 2, 0 ")
    assert cuda_devices() == ["cuda:0", "cuda:2"]
    with Admission().admit(TINY, "cuda") as ticket:
        assert ticket.device == "cuda:2"  # 8 GiB free against GPU 0's 4
    monkeypatch.delenv(GPUS_ENV)
    assert cuda_devices() == ["cuda:0", "cuda:1", "cuda:2"]  # default: every GPU torch sees
    # what the config form checks a config against before it queues: the largest budget among the allowed GPUs
    assert memory_budget_bytes("cuda") == int(12 * GIB * 0.9)
    monkeypatch.setenv(GPUS_ENV, "0,2")
    assert memory_budget_bytes("cuda") == int(8 * GIB * 0.9)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("a,b", "GRAPHVIZ_CORE_GPUS='a,b' is not a comma-separated list of GPU indices such as '0,2'."),
        ("0,,1", "is not a comma-separated list of GPU indices"),
        ("-1", "is not a comma-separated list of GPU indices"),
        ("1,3", "GRAPHVIZ_CORE_GPUS names GPU 3 but torch sees 3 GPU(s) (indices 0 to 2, after CUDA_VISIBLE_DEVICES)"),
        ("1234567", "GRAPHVIZ_CORE_GPUS='1234567' is not a comma-separated list"),  # more than 6 digits
        ("9" * 5000, "GRAPHVIZ_CORE_GPUS='" + "9" * 40 + "' is"),  # the value is cut to its first 40 characters
    ],
)
def test_a_bad_graphviz_core_gpus_is_a_sentence(gpus, monkeypatch, value, says):
    monkeypatch.setenv(GPUS_ENV, value)
    with pytest.raises(CaptureError) as info:
        with Admission().admit(TINY, "cuda"):
            pass
    message = str(info.value)
    assert says in message and "\n" not in message and len(message) < 200


def test_no_gpu_is_a_sentence(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(GPUS_ENV, raising=False)
    with pytest.raises(CaptureError, match="has no usable CUDA device"):
        cuda_devices()
