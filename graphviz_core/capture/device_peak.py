"""The device's peak FLOP/s and memory bandwidth for the roofline, measured once per process by microbenchmark.

A float32 matmul (compute roof) and a large tensor copy (bandwidth roof), each timed for a fraction of a
second on the device itself; CPU and CUDA alike, so the roofline is measured, not looked up.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DevicePeak:
    device: str
    flop_per_s: float  # float32 matmul, n x n
    bytes_per_s: float  # copy: bytes read + bytes written per second
    matmul_n: int
    copy_bytes: int

    @property
    def ridge_flop_per_byte(self) -> float:
        """Arithmetic intensity where the two roofs meet: below it a node is memory-bound."""
        return self.flop_per_s / self.bytes_per_s


def _timed(fn, device: str, budget_s: float) -> float:
    """Seconds per call of fn, best of repeated batches within about budget_s."""
    fn()  # warm up (allocations, kernel selection)
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(4):
            fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / 4)
    return best


@functools.lru_cache(maxsize=4)
def measure_peak(device: str) -> DevicePeak | None:
    """Measured roofs of `device` ("cpu", "cuda" or one GPU, "cuda:N"); None for meta, which runs nothing."""
    if device.partition(":")[0] not in ("cpu", "cuda"):
        return None
    n = 512 if device == "cpu" else 4096
    copy_elems = (32 if device == "cpu" else 256) * 2**20 // 4
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    src = torch.randn(copy_elems, device=device)
    dst = torch.empty_like(src)
    matmul_s = _timed(lambda: torch.mm(a, b), device, 0.15)
    copy_s = _timed(lambda: dst.copy_(src), device, 0.1)
    return DevicePeak(device, 2 * n**3 / matmul_s, 2 * copy_elems * 4 / copy_s, n, copy_elems * 4)
