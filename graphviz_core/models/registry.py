"""The family registry: every architecture this tool can build, by name, and the one way to ask about a config's.

A new architecture is one module defining its `Family` (graphviz_core.models.family) plus its line in `_MODULES`.
Importing this module imports no torch.
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING

from graphviz_core.models.family import Batch, Family, Preset

if TYPE_CHECKING:
    from torch import nn

    from graphviz_core.config import ModelConfig

# Each module's FAMILIES, in the order the form and --model list them.
_MODULES = (
    "graphviz_core.models.builtin",
    "graphviz_core.models.llama_style",
    "graphviz_core.models.gpt2_hf",
    "graphviz_core.models.bert",
    "graphviz_core.models.vision",
    "graphviz_core.models.gemma3",
    "graphviz_core.models.custom",
)

FAMILIES: dict[str, Family] = {
    family.name: family for module in _MODULES for family in importlib.import_module(module).FAMILIES
}
PRESETS: dict[str, Preset] = {preset.name: preset for family in FAMILIES.values() for preset in family.presets}
# A preset's former names (a link or script that names one gets the preset it became).
RENAMED_PRESETS: dict[str, str] = {old: new for family in FAMILIES.values() for old, new in family.renamed_presets}
OFFERED = tuple(name for name, family in FAMILIES.items() if family.offered)


def family_named(name: str) -> Family:
    """The family called `name`; ValueError naming the choices otherwise."""
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(OFFERED)}.")
    return family


def family_of(config: ModelConfig) -> Family:
    """The family of `config` (its `model` field)."""
    return family_named(config.model)


# Initialisation draws from torch's one global generator; captures in other threads (other sessions) seed and draw
# from it too, so seeding and building happen under one lock, and the caller's state is restored.
_BUILD_LOCK = threading.Lock()


def build_model(config: ModelConfig) -> nn.Module:
    """The model for `config` with weights from `config.seed`, in training mode, on the current default device;
    with LoRA adapters and frozen parameters where the config asks (graphviz_core.models.finetune)."""
    import torch

    family = family_of(config)
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = family.build(config)
        if config.finetune == "full" and not config.freeze:
            return model
        from graphviz_core.models.finetune import apply_finetuning  # imports peft (~1 s) only for LoRA

        return apply_finetuning(model, config, family.default_lora_targets(config))


def make_batch(config: ModelConfig, device) -> Batch:
    """Random inputs and targets of the config's shape, reproducible from `config.seed`."""
    return family_of(config).batch(config, device)


def compute_loss(config: ModelConfig, output, targets):
    """The family's loss of `output` against `targets`, computed outside the model's forward."""
    return family_of(config).loss(config, output, targets)
