"""Every family x {FSDP, TP, TP + SP, CP, PP}: the layout runs, or it is refused with the sentence its family declares
(models.family.ParallelPlan: the architectural reason). The table in docs/parallel.md ("Which family takes which
layout") is generated here; GRAPHVIZ_CORE_REWRITE_DOCS=1 rewrites it, otherwise a stale table fails the test.

Each family runs at its tiny preset on meta, tied or untied as the preset is (a tied head is copied to the last
pipeline stage, its gradient summed with the first stage's embedding), Mixtral in bfloat16 (its grouped GEMMs refuse
float32 on meta)."""

import os
import re
from pathlib import Path

import pytest

from graphviz_core.config import FAMILIES, MODELS, config_from_preset
from graphviz_core.parallel.pipeline import simulate_layout
from graphviz_core.parallel.settings import ParallelConfig

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "parallel.md"
LAYOUTS = {
    "FSDP": ParallelConfig(strategy="fsdp", world_size=2),
    "TP": ParallelConfig(strategy="tp", world_size=2, tp=2),
    "TP + SP": ParallelConfig(strategy="tp", world_size=2, tp=2, sequence_parallel=True),
    "CP": ParallelConfig(strategy="fsdp", world_size=2, cp=2),
    "PP": ParallelConfig(strategy="none", world_size=2, pp=2, microbatches=2, schedule="gpipe"),
}
# What each layout needs of a family's declaration, and the declared reason given when it is missing.
DECLARED = {
    "FSDP": lambda plan, family: (family.shardable, "has no repeated layers to shard one by one"),
    "TP": lambda plan, family: (bool(plan.tensor), plan.no_tensor),
    "TP + SP": lambda plan, family: (bool(plan.tensor) and plan.sequence, plan.no_sequence if not plan.sequence
                                     else plan.no_tensor),
    "CP": lambda plan, family: (plan.ring_attention, plan.no_ring),
    "PP": lambda plan, family: (plan.stages is not None, plan.no_stages),
}


def config_of(model: str):
    family = FAMILIES[model]
    overrides = {"device": "meta"}
    if model == "mixtral":
        overrides["dtype"] = "bfloat16"
    return config_from_preset(family.presets[0].name, **overrides)


def cell(model: str, layout: str) -> tuple[bool, str]:
    """(runs, what it showed): rank 0's peak, or the refusal's sentence."""
    try:
        result = simulate_layout(config_of(model), LAYOUTS[layout], single_device=False)
    except ValueError as refused:
        return False, str(refused)
    return True, f"{result.peak_bytes:,} B"


MATRIX: dict[tuple[str, str], tuple[bool, str]] = {}


@pytest.mark.parametrize("model", MODELS)
def test_each_cell_runs_or_is_refused_with_its_familys_reason(model):
    plan, family = FAMILIES[model].parallel, FAMILIES[model]
    for layout in LAYOUTS:
        runs, shown = MATRIX[model, layout] = cell(model, layout)
        declared, reason = DECLARED[layout](plan, family)
        if runs:
            assert declared, f"{model} {layout} ran although its family declares it cannot"
            assert int(shown.split()[0].replace(",", "")) > 0
        elif declared:  # allowed by the family: refused only by this config's shape, said in a sentence
            assert shown.endswith(".") and "Traceback" not in shown, (model, layout, shown)
            pytest.fail(f"{model} {layout}: the family declares it, but the tiny preset was refused: {shown}")
        else:
            assert reason and reason in shown, (model, layout, shown)  # the family's own reason, word for word


def test_gemma3_gpt2_and_mixtral_run_under_context_parallel_and_gemma3_and_gpt2_under_pipelines():
    # The families that gained a layout in this change, each in its own module (gemma3.py, gpt2_hf.py,
    # llama_style.py's Mixtral): the ring runs their attention (one key/value all-gather per layer forward).
    for model in ("gemma3", "gpt2-hf", "mixtral"):
        result = simulate_layout(config_of(model), LAYOUTS["CP"], single_device=False)
        ring = [c for c in result.collectives if c.group == "cp" and c.phase == "forward" and c.parameters_of is None]
        assert len(ring) == config_of(model).layers, model
    piped = simulate_layout(config_of("gemma3"), LAYOUTS["PP"], single_device=False)
    assert [s.layers for s in piped.pipeline.per_stage] == [(0, 3), (3, 6)]  # gemma3-tiny's 6 layers, 3 + 3
    # Both tie their head to the token embedding (gemma3-tiny's preset, GPT-2 always): one all-reduce of the
    # V x h weight's gradient between the first and the last stage, V = 512, h = 64, float32 (Mixtral: bfloat16)
    assert config_of("gemma3").tied
    for model in ("gemma3", "gpt2-hf"):
        piped = simulate_layout(config_of(model), LAYOUTS["PP"], single_device=False)
        summed = [c for c in piped.collectives if c.group == "embedding"]
        assert [(c.kind, c.buffer_bytes, c.ranks) for c in summed] == [("all_reduce", 512 * 64 * 4, (0, 1))], model


def test_a_sliding_window_past_the_ring_is_refused():
    config = config_of("gemma3").replace(seq=1024)  # Gemma 3's sliding layers mask past 512 tokens
    with pytest.raises(ValueError, match="past 512 tokens"):
        simulate_layout(config, LAYOUTS["CP"], single_device=False)


def table() -> str:
    """The matrix as Markdown: a tick where the layout runs, a footnote number where it is refused."""
    reasons: list[str] = []
    rows = ["| family | " + " | ".join(LAYOUTS) + " |", "| --- |" + " --- |" * len(LAYOUTS)]
    for model in MODELS:
        cells = []
        for layout in LAYOUTS:
            runs, shown = MATRIX[model, layout]
            if runs:
                cells.append("runs")
                continue
            declared, reason = DECLARED[layout](FAMILIES[model].parallel, FAMILIES[model])
            text = reason if reason and reason in shown else shown
            if text not in reasons:
                reasons.append(text)
            cells.append(f"no ({reasons.index(text) + 1})")
        rows.append(f"| {FAMILIES[model].title} (`{model}`) | " + " | ".join(cells) + " |")
    notes = [f"{i}. {text[0].upper()}{text[1:]}." for i, text in enumerate(reasons, 1)]
    return "\n".join(rows) + "\n\n" + "\n".join(notes) + "\n"


BEGIN, END = "<!-- matrix: tests/test_parallel_matrix.py -->", "<!-- end of matrix -->"


def test_the_docs_table_is_the_matrix():
    if len(MATRIX) < len(MODELS) * len(LAYOUTS):  # the cells run above (one file, one worker, in order)
        for model in MODELS:
            for layout in LAYOUTS:
                MATRIX.setdefault((model, layout), cell(model, layout))
    text = DOC.read_text(encoding="utf-8")
    current = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    wanted = table()
    if os.environ.get("GRAPHVIZ_CORE_REWRITE_DOCS"):
        DOC.write_text(text.replace(current.group(0), f"{BEGIN}\n{wanted}{END}"), encoding="utf-8")
        return
    assert current is not None and current.group(1) == wanted, (
        "docs/parallel.md's matrix is stale: GRAPHVIZ_CORE_REWRITE_DOCS=1 pytest tests/test_parallel_matrix.py")
