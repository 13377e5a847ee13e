"""The memory panel as JSON, for `graphviz-core memory`: peak, timeline and training step of one capture, plus
the checkpoint comparison and the will-it-fit search when asked for."""

from __future__ import annotations

import dataclasses

from graphviz_core.analysis.checkpointing import compare_checkpointing
from graphviz_core.analysis.finetuning import compare_finetuning
from graphviz_core.analysis.fit import will_it_fit
from graphviz_core.analysis.step_terms import step_parts
from graphviz_core.analysis.training_step import accelerator_fits, training_step_of
from graphviz_core.capture.engine import capture_backward
from graphviz_core.config import ModelConfig


def memory_report(
    config: ModelConfig, optimizer: str | None = None, checkpoints: bool = False, budget_bytes: int | None = None
) -> dict:
    """Keys: config, device, kept_for_backward_bytes (saved + held for recompute), saved_bytes,
    checkpoint_held_bytes, peak_bytes, timeline, training_step, accelerators; `checkpoints` (one row per
    policy, captured on meta) with checkpoints=True; `fit` (largest batch and seq per policy) with a budget;
    `finetuning` (full fine-tuning and this config's LoRA or freezing, both captured on meta) when it fine-tunes.
    `optimizer` defaults to the config's, whose state the capture read from torch.optim after one step."""
    optimizer = optimizer or config.optimizer
    capture = capture_backward(config)
    step = training_step_of(capture, optimizer)
    report = {
        "config": config.to_dict(),
        "device": capture.device,
        "kept_for_backward_bytes": capture.memory.kept_for_backward_bytes,  # the headline: saved + held
        "saved_bytes": capture.memory.saved_bytes,
        "checkpoint_held_bytes": capture.memory.checkpoint_held_bytes,
        "peak_bytes": capture.memory.peak_bytes,
        "timeline": capture.timeline.to_dict(),
        "training_step": dataclasses.asdict(step),
        "training_step_terms": [{"term": t, "bytes": b, "what": w} for t, b, w in step_parts(capture, step)],
        "optimizer": dataclasses.asdict(capture.optimizer) if capture.optimizer else None,
        "autocast": dataclasses.asdict(capture.autocast) if capture.autocast else None,
        "notes": list(capture.notes),
        "accelerators": [dataclasses.asdict(f) for f in accelerator_fits(step.step_peak_bytes)],
    }
    if config.finetune == "lora" or config.freeze:  # what fine-tuning fewer parameters saves, against full
        both = compare_finetuning(config, optimizer=optimizer)
        report["finetuning"] = {
            "device": both.device, "full": dataclasses.asdict(both.full), "tuned": dataclasses.asdict(both.tuned),
        }
    if checkpoints:
        table = compare_checkpointing(config, optimizer=optimizer)
        report["checkpoints"] = {"device": table.device, "rows": [dataclasses.asdict(r) for r in table.rows]}
    if budget_bytes is not None:
        search = will_it_fit(config, budget_bytes, optimizer, parameter_count=capture.summary.parameter_count,
                             frozen_parameter_count=capture.summary.frozen_parameter_count)
        report["fit"] = {
            "budget_bytes": budget_bytes,
            "optimizer": optimizer,
            "results": [dataclasses.asdict(r) for r in search.results],
        }
    return report
