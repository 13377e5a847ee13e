"""Full fine-tuning against LoRA (or frozen parameters), side by side: the same config captured both ways.

What LoRA saves comes from autograd itself: a frozen weight gets no `AccumulateGrad` node, no gradient, no
optimizer state and no weight-gradient GEMM (2·tokens·in·out FLOPs per frozen linear weight), and a frozen linear
layer keeps no copy of its input for backward (only its weight's gradient reads it). What it does not save: the
weights stay in memory, every layer whose output leads to an adapter still runs its input-gradient GEMM, and the
activations the adapters and every other op's backward need are saved as before (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models", section 4: the memory saved is the optimizer state of the frozen weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from graphviz_core.analysis.training_step import training_step_of
from graphviz_core.capture.result import Capture
from graphviz_core.capture.workers import capture_many
from graphviz_core.config import LORA_ALPHA, LORA_RANK, ModelConfig


@dataclass(frozen=True)
class FinetuneSide:
    """One way of fine-tuning, from its own capture."""

    label: str  # "full fine-tuning", "LoRA r=8, alpha 16 on q_proj, v_proj"
    trainable_parameters: int  # scalars that get a gradient
    trainable_tensors: int  # AccumulateGrad nodes
    frozen_parameters: int  # scalars with requires_grad off
    parameter_bytes: int  # every weight, frozen or not
    gradient_bytes: int
    master_weight_bytes: int
    optimizer_state_bytes: int
    saved_bytes: int  # saved for backward (activations)
    activation_peak_bytes: int
    step_peak_bytes: int
    forward_flops: int
    backward_flops: int
    backward_matmul_flops: int  # the matmul category: where the weight-gradient GEMMs are
    nodes: int


@dataclass(frozen=True)
class FinetuneComparison:
    config: ModelConfig  # the fine-tuned side's config
    device: str
    optimizer: str
    full: FinetuneSide
    tuned: FinetuneSide

    @property
    def adapters(self) -> bool:
        """Whether the tuned side adds LoRA adapters (else it only freezes parameters)."""
        return self.config.finetune == "lora"

    def savings(self) -> list[tuple[str, int, int, str]]:
        """(what, full, tuned, why) for each figure, what LoRA saves first, what it does not after. Where the tuned
        side only freezes parameters, no sentence speaks of adapters."""
        f, t = self.full, self.tuned
        plus = (lambda words: words) if self.adapters else (lambda words: "")
        return [
            ("trainable parameters", f.trainable_parameters, t.trainable_parameters,
             "scalars that get a gradient: " + ("the adapters (and whatever is not frozen)" if self.adapters
                                                else "the parameters not frozen")),
            ("AccumulateGrad nodes", f.trainable_tensors, t.trainable_tensors,
             "one per trainable tensor; a frozen weight gets none"),
            ("gradients (bytes)", f.gradient_bytes, t.gradient_bytes, "for the trainable parameters only"),
            ("optimizer state (bytes)", f.optimizer_state_bytes, t.optimizer_state_bytes,
             "kept for the trainable parameters only"),
            ("fp32 master weights (bytes)", f.master_weight_bytes, t.master_weight_bytes,
             "16-bit training keeps fp32 copies of what it updates" if f.master_weight_bytes or t.master_weight_bytes
             else "none kept: float32 weights are their own master copy (16-bit training keeps fp32 copies)"),
            ("backward FLOPs", f.backward_flops, t.backward_flops,
             "no weight-gradient GEMM for a frozen weight (2·tokens·in·out each)" + plus(", plus the adapters' small GEMMs")),
            ("backward matmul FLOPs", f.backward_matmul_flops, t.backward_matmul_flops,
             "where the weight-gradient GEMMs were"),
            ("weights (bytes)", f.parameter_bytes, t.parameter_bytes,
             "not spared: the frozen weights stay in memory" + plus(", plus the adapters")),
            ("saved for backward (bytes)", f.saved_bytes, t.saved_bytes,
             "mostly not spared: only a frozen layer's own input copy goes (its weight gradient was its one reader)"),
            ("activation peak (bytes)", f.activation_peak_bytes, t.activation_peak_bytes,
             "most bytes live besides weights and gradients"),
            ("forward FLOPs", f.forward_flops, t.forward_flops,
             "not spared: the forward runs every weight" + plus(", plus the adapters")),
            ("step peak (bytes)", f.step_peak_bytes, t.step_peak_bytes,
             "forward + backward peak + master weights + optimizer state"),
        ]


def full_twin(config: ModelConfig) -> ModelConfig:
    """`config` with every parameter trained: no LoRA, nothing frozen."""
    return config.replace(finetune="full", lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, lora_targets="", freeze="")


def tuned_twin(config: ModelConfig) -> ModelConfig:
    """`config` itself when it fine-tunes with LoRA or freezes something; LoRA at its defaults otherwise."""
    if config.finetune == "lora" or config.freeze:
        return config
    return config.replace(finetune="lora")


def comparison_title(tuned: ModelConfig) -> str:
    """The side-by-side's title: LoRA where the tuned side adds adapters, frozen parameters where it only freezes."""
    return "Full fine-tuning vs LoRA" if tuned.finetune == "lora" else "Full fine-tuning vs frozen parameters"


def finetune_label(config: ModelConfig) -> str:
    """How `config` fine-tunes, in words ("full fine-tuning", "LoRA r=8, alpha 16 on q_proj, v_proj")."""
    return config.finetuning_words() or "full fine-tuning"


def finetune_side(capture: Capture, optimizer: str = "adamw") -> FinetuneSide:
    step = training_step_of(capture, optimizer)
    s, m, f = capture.summary, capture.memory, capture.flops
    return FinetuneSide(
        label=finetune_label(capture.config),
        trainable_parameters=s.parameter_count,
        trainable_tensors=s.parameters,
        frozen_parameters=s.frozen_parameter_count,
        parameter_bytes=step.parameter_bytes,
        gradient_bytes=step.gradient_bytes,
        master_weight_bytes=step.master_weight_bytes,
        optimizer_state_bytes=step.optimizer_state_bytes,
        saved_bytes=m.saved_bytes,
        activation_peak_bytes=step.activation_peak_bytes,
        step_peak_bytes=step.step_peak_bytes,
        forward_flops=f.forward,
        backward_flops=f.backward,
        backward_matmul_flops=f.backward_by_category.get("matmul", 0),
        nodes=s.nodes,
    )


def compare_finetuning(
    config: ModelConfig,
    device: str = "meta",
    optimizer: str = "adamw",
    progress: Callable[[str], None] | None = None,
) -> FinetuneComparison:
    """Capture full fine-tuning and `config`'s fine-tuning (LoRA at its defaults when `config` trains everything)
    on `device` (meta by default: shapes only, quick at any size) and put them side by side."""
    captures = capture_many(list(finetune_configs(config, device)), progress=progress)
    return finetune_table(config, optimizer, captures[0], captures[1])


def finetune_configs(config: ModelConfig, device: str = "meta") -> tuple[ModelConfig, ModelConfig]:
    """The two configs the comparison captures: every parameter trained, and `config`'s fine-tuning (LoRA at its
    defaults when `config` trains everything), on `device`."""
    return full_twin(config).replace(device=device), tuned_twin(config).replace(device=device)


def finetune_table(config: ModelConfig, optimizer: str, full: Capture, tuned: Capture) -> FinetuneComparison:
    """The comparison of the two captures already made (finetune_configs): a pure function of them."""
    return FinetuneComparison(tuned_twin(config), full.device, optimizer, finetune_side(full, optimizer),
                              finetune_side(tuned, optimizer))
