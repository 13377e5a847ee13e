"""Picks the device for a capture, estimates what a config costs (bytes, FLOPs), measures each device's
memory budget, and turns out-of-memory into a sentence. `graphviz_core.capture.admission` decides who runs when.

CUDA is never initialised at import time: everything that asks CUDA anything is inside a function.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from graphviz_core.capture.instruments.optimizer import OPTIMIZER_STATES
from graphviz_core.config import ModelConfig
from graphviz_core.models.registry import family_of

DEVICE_ENV = "GRAPHVIZ_CORE_DEVICE"  # overrides what `auto` picks, e.g. GRAPHVIZ_CORE_DEVICE=cpu on a GPU box
CPU_BUDGET_ENV = "GRAPHVIZ_CORE_CPU_BUDGET_BYTES"
CUDA_BUDGET_ENV = "GRAPHVIZ_CORE_CUDA_BUDGET_BYTES"
GPUS_ENV = "GRAPHVIZ_CORE_GPUS"  # which of the GPUs torch sees captures may use, e.g. "0,2" (default: all of them)
BYTES_PER = {"float32": 4, "bfloat16": 2, "float16": 2}
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup on each hierarchy
# Share of the free memory a capture may plan to use: the estimate is rough and the server needs headroom.
CPU_BUDGET_SHARE = 0.6


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
        raise CaptureError(
            "device 'cuda' was asked for but this machine has no usable CUDA device; use 'cpu' or 'meta'."
        )
    return requested


def cuda_devices() -> list[str]:
    """The GPUs captures may be placed on, as "cuda:N": every GPU torch sees (CUDA_VISIBLE_DEVICES already limits
    those, and renumbers them from 0), or the indices GRAPHVIZ_CORE_GPUS lists, e.g. "0,2"."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    raw = os.environ.get(GPUS_ENV, "").strip()
    if not raw:
        indices = list(range(count))
    else:
        parts = [part.strip() for part in raw.split(",")]
        if not all(part.isdigit() and len(part) <= 6 for part in parts):  # int() of thousands of digits raises
            raise CaptureError(
                f"{GPUS_ENV}={raw[:40]!r} is not a comma-separated list of GPU indices such as '0,2'."
            )
        indices = sorted({int(part) for part in parts})
        outside = [index for index in indices if index >= count]
        if outside:
            raise CaptureError(
                f"{GPUS_ENV} names GPU {outside[0]} but torch sees {count} GPU(s) (indices 0 to {count - 1}, "
                f"after CUDA_VISIBLE_DEVICES); list only those."
            )
    if not indices:
        raise CaptureError("device 'cuda' was asked for but this machine has no usable CUDA device; use 'cpu' or 'meta'.")
    return [f"cuda:{index}" for index in indices]


def cuda_index(device: str) -> int | None:
    """N for "cuda:N"; None for any other device (plain "cuda" included: the current GPU)."""
    kind, _, index = device.partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else None


def estimate_peak_bytes(config: ModelConfig) -> int:
    """A deliberately rough upper estimate of training memory, used only to refuse configs early: the larger of
    backward's peak (weights, gradients and the family's estimate of what the model keeps for backward,
    Family.activation_elements) and the optimizer step's (weights, gradients and the state the config's optimizer
    builds in its first step: two tensors shaped like the weights for Adam and AdamW, one for SGD with momentum)."""
    family = family_of(config)
    parameters = family.parameter_count(config)
    backward = 2 * parameters + family.activation_elements(config)
    step = (2 + OPTIMIZER_STATES.get(config.optimizer, 0)) * parameters
    return int(BYTES_PER[config.dtype] * max(backward, step))


def estimate_training_flops(config: ModelConfig) -> int:
    """A rough count of forward + backward FLOPs, used only to refuse configs that would run for minutes
    (Family.training_flops)."""
    return int(family_of(config).training_flops(config))


def parameter_count_estimate(config: ModelConfig) -> int:
    """Parameters of the model `config` builds (exact for the shipped models)."""
    return family_of(config).parameter_count(config)


def memory_budget_bytes(device: str) -> int | None:
    """How much memory captures may plan to use on `device` together; None for meta (nothing is allocated).

    One GPU, "cuda:N": 90% of its free memory; "cuda": the largest of those over the GPUs captures may use
    (cuda_devices); GRAPHVIZ_CORE_CUDA_BUDGET_BYTES overrides it (the same figure for every GPU). CPU: 60% of the room left, where the room is the smaller of the machine's MemAvailable and what the
    container's memory limit (cgroup v2 or v1) still allows; GRAPHVIZ_CORE_CPU_BUDGET_BYTES overrides it.
    """
    if device == "meta":
        return None
    if device.startswith("cuda"):
        env = os.environ.get(CUDA_BUDGET_ENV)
        if env:
            return int(env)  # per GPU
        index = cuda_index(device)
        if index is None:  # "cuda": the largest of the GPUs a capture may be placed on
            return max(memory_budget_bytes(gpu) for gpu in cuda_devices())
        free, _total = torch.cuda.mem_get_info(index)
        return int(free * 0.9)
    env = os.environ.get(CPU_BUDGET_ENV)
    if env:
        return int(env)
    room = _available_ram_bytes()
    container = container_room_bytes()
    if container is not None:
        room = min(room, container)
    return int(room * CPU_BUDGET_SHARE)


def container_room_bytes(root: Path | None = None, self_cgroup: Path | None = None) -> int | None:
    """Bytes this process may still allocate before a cgroup memory limit stops it: the least room over its own
    cgroup and each of its ancestors (a limit anywhere above applies too), reclaimable page cache counted as free;
    None when none of them sets a limit.

    `self_cgroup` (/proc/self/cgroup) names the process's cgroup on each hierarchy: cgroup v2's `0::/path`, read under
    `root` (`memory.max`), and v1's memory controller `N:...memory...:/path`, read under `root/memory`
    (`memory.limit_in_bytes`). A path that does not exist under the mount (a container that sees its host's names)
    leaves the folders that do: the mount itself is then the container's own cgroup.
    """
    root = root or CGROUP_ROOT
    own = _own_cgroups(self_cgroup or PROC_SELF_CGROUP)
    rooms = [
        room
        for mount, path, files in (
            (root, own.get("v2", "/"), ("memory.max", "memory.current", "inactive_file")),
            (root / "memory", own.get("v1", "/"), ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")),
        )
        for folder in _self_and_ancestors(mount, path)
        if (room := _room(folder, *files)) is not None
    ]
    return min(rooms) if rooms else None


def _own_cgroups(self_cgroup: Path) -> dict[str, str]:
    """{"v2": path, "v1": path of the memory controller} from /proc/self/cgroup's `id:controllers:path` lines."""
    own: dict[str, str] = {}
    for line in (_read(self_cgroup) or "").splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            own["v2"] = path
        elif "memory" in controllers.split(","):
            own["v1"] = path
    return own


def _self_and_ancestors(mount: Path, path: str) -> list[Path]:
    """The folders of `path`'s cgroup and of each cgroup above it, up to the mount, that exist under `mount`."""
    parts = [part for part in path.split("/") if part and part not in (".", "..")]
    folders = [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [folder for folder in folders if folder.is_dir()]


def _room(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    """Limit minus usage plus reclaimable cache for one cgroup folder; None when it sets no limit."""
    raw = _read(folder / limit_file)
    if raw is None or raw == "max" or not raw.isdigit() or int(raw) >= 2**60:  # v1 writes "none" as ~2**63
        return None
    usage = _read(folder / usage_file) or "0"
    inactive = 0
    for line in (_read(folder / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key == inactive_key and value.strip().isdigit():
            inactive = int(value)
    return max(0, int(raw) - (int(usage) if usage.isdigit() else 0) + inactive)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_budget(config: ModelConfig, device: str, budget: int | None = None) -> None:
    """Raise CaptureError, with what to change, when `config` will not fit on `device`'s budget (measured
    now unless given)."""
    if device == "meta":
        return
    budget = memory_budget_bytes(device) if budget is None else budget
    need = estimate_peak_bytes(config)
    if need > budget:
        env = CPU_BUDGET_ENV if device == "cpu" else CUDA_BUDGET_ENV
        raise CaptureError(
            f"this config needs about {need / 2**30:.1f} GiB on {device} but the budget there is "
            f"{budget / 2**30:.1f} GiB (the free memory, or {env}); lower batch or seq, use checkpoint "
            f"'full', pick an optimizer with less state (sgd keeps none), or run it on device 'meta' (shapes only)."
        )


@contextlib.contextmanager
def device_guard(device: str) -> Iterator[None]:
    """Turn out-of-memory into a CaptureError after memory is released (admission serialises GPU captures)."""
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
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        raise CaptureError(
            f"out of memory on {device} ({out_of_memory}); try a smaller batch or seq, checkpoint 'full' or "
            f"'selective', or a 'meta' dry run."
        )


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
