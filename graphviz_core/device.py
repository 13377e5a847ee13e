"""Picks the device for a capture, refuses configs that will not fit, and serialises GPU captures.

CUDA is never initialised at import time: everything that asks CUDA anything is inside a function.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

import torch

from graphviz_core.config import ModelConfig

DEVICE_ENV = "GRAPHVIZ_CORE_DEVICE"  # overrides what `auto` picks, e.g. GRAPHVIZ_CORE_DEVICE=cpu on a GPU box
CPU_BUDGET_ENV = "GRAPHVIZ_CORE_CPU_BUDGET_BYTES"
CUDA_BUDGET_ENV = "GRAPHVIZ_CORE_CUDA_BUDGET_BYTES"
BYTES_PER = {"float32": 4, "bfloat16": 2, "float16": 2}

# Several Streamlit sessions share one process; one GPU capture at a time keeps them from OOM-ing each other.
_GPU_CAPTURES = threading.BoundedSemaphore(1)


class CaptureError(ValueError):
    """A capture the user can fix by changing the config (too big, out of memory, device missing)."""


def resolve_device(requested: str) -> str:
    """`auto` -> `cuda` when available, else `cpu` (the env var GRAPHVIZ_CORE_DEVICE may override)."""
    if requested == "auto":
        override = os.environ.get(DEVICE_ENV, "").strip()
        if override:
            if override not in ("cpu", "cuda", "meta"):
                raise CaptureError(f"{DEVICE_ENV}={override!r} is not one of cpu, cuda, meta.")
            requested = override
        else:
            return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise CaptureError("device 'cuda' was asked for but this machine has no usable CUDA device; use 'cpu' or 'meta'.")
    return requested


def estimate_peak_bytes(config: ModelConfig) -> int:
    """A deliberately rough upper estimate of training memory, used only to refuse configs early.

    Weights + gradients, plus activations from Korthikanti et al. (2022): about 34·s·b·h bytes per layer
    at 2 bytes/element (17 elements per token per hidden unit), plus 5·a·s²·b bytes (2.5 elements) per
    layer where attention materialises the s x s scores (`manual`), plus logits and their gradients.
    """
    elem = BYTES_PER[config.dtype]
    b, s, h, L, a = config.batch, config.seq, config.hidden, config.layers, config.heads
    params = parameter_count_estimate(config)
    per_layer_elems = 17 * s * b * h + (2.5 * a * s * s * b if config.attention == "manual" else 0)
    if config.model == "mlp":
        per_layer_elems = 10 * s * b * h
    logits = 3 * b * s * config.vocab if config.model == "gpt2" else 0
    return int(elem * (2 * params + L * per_layer_elems + logits))


def parameter_count_estimate(config: ModelConfig) -> int:
    """Parameters of the model `config` builds (exact for the shipped models)."""
    h, L = config.hidden, config.layers
    mlp = 8 * h * h + 5 * h  # fc (h x 4h + 4h) + proj (4h x h + h)
    if config.model == "mlp":
        return L * mlp
    block = 4 * h * h + 4 * h + mlp + 4 * h  # qkv + proj, their biases, MLP, two LayerNorms
    if config.model == "block":
        return block
    return config.vocab * h + config.positions * h + L * block + 2 * h  # wte (tied lm_head), wpe, blocks, ln_f


def memory_budget_bytes(device: str) -> int | None:
    """How much memory a capture may plan to use on `device`; None for meta (nothing is allocated)."""
    if device == "meta":
        return None
    if device == "cuda":
        env = os.environ.get(CUDA_BUDGET_ENV)
        if env:
            return int(env)
        free, _total = torch.cuda.mem_get_info()
        return int(free * 0.9)
    env = os.environ.get(CPU_BUDGET_ENV)
    if env:
        return int(env)
    return int(_available_ram_bytes() * 0.6)


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_budget(config: ModelConfig, device: str) -> None:
    """Raise CaptureError, with what to change, when `config` will not fit on `device`."""
    budget = memory_budget_bytes(device)
    if budget is None:
        return
    need = estimate_peak_bytes(config)
    if need > budget:
        raise CaptureError(
            f"this config needs about {need / 2**30:.1f} GiB on {device} but the budget there is "
            f"{budget / 2**30:.1f} GiB; lower batch or seq, use checkpoint 'full', or run it on device 'meta' "
            f"(shapes only)."
        )


@contextlib.contextmanager
def device_guard(device: str) -> Iterator[None]:
    """Serialise GPU captures and turn out-of-memory into a CaptureError after memory is released."""
    lock = _GPU_CAPTURES if device == "cuda" else contextlib.nullcontext()
    with lock:
        out_of_memory = None
        try:
            yield
        except torch.cuda.OutOfMemoryError as exc:
            out_of_memory = str(exc).splitlines()[0]
        except RuntimeError as exc:
            if "can't allocate memory" not in str(exc) and "out of memory" not in str(exc).lower():
                raise
            out_of_memory = str(exc).splitlines()[0]
        # Release outside the except block: the exception's traceback holds frames that hold tensors.
        if out_of_memory is not None:
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            raise CaptureError(
                f"out of memory on {device} ({out_of_memory}); try a smaller batch or seq, checkpoint 'full' or "
                f"'selective', or a 'meta' dry run."
            )


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
