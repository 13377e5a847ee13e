"""Fine-tuning applied to a built model: LoRA adapters from `peft` (Hu et al. 2021, "LoRA: Low-Rank Adaptation of
Large Language Models") on the chosen modules, and `--freeze GLOB` turning parameters' gradients off.

A frozen parameter (requires_grad False) gets no `AccumulateGrad` node and no weight-gradient matmul: autograd
itself leaves them out, so the graph, the FLOPs and the gradient bytes of a capture show what LoRA saves.

peft wraps the model in a `PeftModel`; the capture runs the model inside it (`get_base_model()`), where the
adapters were injected in place, so module paths and parameter names read as with full fine-tuning
(`model.layers.0.self_attn.q_proj.base_layer.weight`, `….q_proj.lora_A.default.weight`) and a compare of full
against LoRA lines the two graphs up module by module.
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import TYPE_CHECKING

from torch import nn

from graphviz_core.units import some_of

if TYPE_CHECKING:
    from graphviz_core.config import ModelConfig

SHOWN_NAMES = 8  # real names an error message lists


def apply_finetuning(model: nn.Module, config: ModelConfig, default_targets: tuple[str, ...]) -> nn.Module:
    """`model` with LoRA adapters (config.finetune == "lora") and frozen parameters (config.freeze) applied."""
    if config.finetune == "lora":
        model = add_lora(model, config, lora_target_names(config, default_targets))
    if config.freeze:
        freeze(model, config.freeze)
    if not any(p.requires_grad for p in model.parameters()):  # the loss would have no graph to walk or step to take
        raise ValueError(f"--freeze {config.freeze!r} leaves no parameter training (LoRA's adapters included), so "
                         "there is no backward pass to show; narrow the glob, e.g. '*embed*'.")
    return model


def lora_target_names(config: ModelConfig, default_targets: tuple[str, ...]) -> tuple[str, ...]:
    """The names LoRA adapts: config.lora_targets (comma-separated) or the family's defaults."""
    given = tuple(name for name in config.lora_targets.split(",") if name)
    return given or default_targets


def matching_modules(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Full paths of the modules a target names: the path's last parts equal it (`q_proj` matches
    `model.layers.0.self_attn.q_proj`, as peft matches) or, with wildcards, the whole path fits it (fnmatch)."""
    found = []
    for path, _ in model.named_modules():
        if not path:
            continue
        for target in targets:
            if _has_wildcard(target):
                hit = fnmatch.fnmatchcase(path, target)
            else:
                hit = path == target or path.endswith("." + target)
            if hit:
                found.append(path)
                break
    return found


def add_lora(model: nn.Module, config: ModelConfig, targets: tuple[str, ...]) -> nn.Module:
    """peft's LoRA (rank config.lora_rank, scale lora_alpha / rank, no dropout) on every module `targets` name,
    every other parameter frozen; ValueError naming real modules when a target matches none."""
    from peft import LoraConfig, get_peft_model

    paths = matching_modules(model, targets)
    for target in targets:
        if not matching_modules(model, (target,)):
            raise ValueError(
                f"LoRA target {target!r} matches no module of this model; modules it has include: "
                f"{some_of(_leaf_names(model), SHOWN_NAMES)}."
            )
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0, target_modules=paths)
    try:
        with warnings.catch_warnings():
            # peft warns that GPT-2's Conv1D needs fan_in_fan_out=True, then sets it itself
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            # peft asks transformers' deprecated is_gradient_checkpointing; nothing a user can act on
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = get_peft_model(model, lora)
    except ValueError:  # a module of a kind LoRA cannot adapt (a norm, a whole block)
        kinds = sorted({type(model.get_submodule(p)).__name__ for p in paths})
        raise ValueError(
            f"LoRA adapts linear, convolution and embedding layers; {', '.join(targets)} named {', '.join(kinds)}, "
            f"which it cannot adapt. Name linear layers instead, e.g. {some_of(_linear_names(model), SHOWN_NAMES)}."
        ) from None
    return wrapped.get_base_model()


def freeze(model: nn.Module, pattern: str) -> int:
    """Turn off requires_grad on every parameter whose name fits one of `pattern`'s comma-separated globs
    (fnmatch); the number frozen. ValueError listing real names when a glob fits none."""
    names = [name for name, _ in model.named_parameters()]
    frozen = 0
    for glob in (g for g in pattern.split(",") if g):
        hits = [name for name in names if fnmatch.fnmatchcase(name, glob)]
        if not hits:
            raise ValueError(
                f"--freeze {glob!r} matches no parameter; parameter names include: {some_of(names, SHOWN_NAMES)} "
                f"(a glob matches the whole name: '*embed*' finds embed anywhere in it)."
            )
        for name, parameter in model.named_parameters():
            if name in hits and parameter.requires_grad:
                parameter.requires_grad_(False)
                frozen += 1
    return frozen


def _has_wildcard(text: str) -> bool:
    return any(c in text for c in "*?[")


def _leaf_names(model: nn.Module) -> list[str]:
    """The distinct last parts of the paths of modules that hold parameters themselves (linear, norm, embedding):
    the names a target can use."""
    return _last_parts(model, lambda m: any(True for _ in m.parameters(recurse=False)))


def _linear_names(model: nn.Module) -> list[str]:
    """The distinct last parts of the paths of linear layers."""
    return _last_parts(model, lambda m: isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")


def _last_parts(model: nn.Module, keep) -> list[str]:
    seen: dict[str, None] = {}
    for path, module in model.named_modules():
        if path and keep(module):
            seen[path.rpartition(".")[2]] = None
    return list(seen)
