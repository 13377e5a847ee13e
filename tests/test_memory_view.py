"""The Memory tab: AppTest (real values rendered, actions run) and a real browser reading the panel's peak
and checking it against the CLI's JSON."""

import json
import re

import pytest

from graphviz_core.cli import main
from graphviz_core.ui.format import format_bytes
from tests.conftest import captured, explorer_tab, tables


def test_memory_tab_shows_the_peak_and_runs_both_actions():
    at = explorer_tab("Memory", 180)
    assert not at.exception
    capture = captured("gpt2-tiny")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Peak memory"] == format_bytes(capture.memory.peak_bytes)
    assert any(t.value.startswith(f"Peak: {capture.memory.peak_bytes:,} bytes") for t in at.text)
    next(b for b in at.button if b.label == "Compare the checkpointing policies").click().run()
    assert not at.exception
    table = next(d.value for d in at.dataframe if "checkpointing" in d.value.columns and "held for recompute" in d.value.columns)
    assert list(table["checkpointing"]) == ["none", "full", "selective-attention", "selective-ops",
                                            "selective-ops-torchtitan"]
    # full on gpt2-tiny: 2 blocks hold their (2, 32, 64) fp32 input, 2 * 16 KiB
    assert table.loc[1, "held for recompute"] == "32.0 KiB"
    # each policy is explained by its own sentence, through the family
    from graphviz_core.config import config_from_preset

    config = config_from_preset("gpt2-tiny")
    caption = next(c.value for c in at.caption if "The policies:" in c.value)
    for policy in table["checkpointing"]:
        assert f"{policy}: {config.family.checkpoint_note(policy, config)}." in caption
    next(b for b in at.button if b.label.startswith("Find the largest")).click().run()
    assert not at.exception
    fit = next(d.value for d in at.dataframe if "largest batch (measured)" in d.value.columns)
    assert len(fit) == 5  # one row per policy gpt2-tiny offers (CHECKPOINTS: none, full and 3 selective)


def test_the_training_step_table_wraps_so_every_why_reads_whole():
    at = explorer_tab("Memory", 180)
    assert not at.exception
    # st.dataframe cut this to "measured forward + backward peak + master weights + optir…" at 1280 px
    step = next(t for t in tables(at) if "why" in t.columns).set_index("part")
    assert step.loc["step peak", "why"] == "measured forward + backward peak + master weights + optimizer state"
    # gpt2-tiny in float32: 134,912 parameters × 4 B = 539,648 B = 527.0 KiB
    assert step.loc["weights", ["bytes", "why"]].tolist() == ["527.0 KiB", "134,912 parameters × float32"]
    # AdamW as torch.optim keeps it after the capture's step: two fp32 moments per parameter (527.0 KiB each) and a
    # 4 B step count per parameter tensor (gpt2-tiny: 28 tensors = wte, wpe, 2 blocks x 12, ln_f's weight and bias;
    # lm_head is tied to wte): 28 x 4 = 112 B
    assert step.loc["optimizer state", "why"] == (
        "AdamW: exp_avg 527.0 KiB + exp_avg_sq 527.0 KiB + step 112 B (torch.optim after one step)")
    assert not [d for d in at.dataframe if "why" in d.value.columns]


@pytest.mark.browser
def test_the_panels_peak_in_a_browser_equals_the_cli_json(page, streamlit_url, tmp_path):
    out = tmp_path / "graph.json"
    assert main(["graph", "--preset", "gpt2-tiny", "--device", "cpu", "-o", str(out)]) == 0
    memory = json.loads(out.read_text())["memory"]
    page.goto(streamlit_url)
    page.get_by_role("tab", name="Memory").click()
    text = page.get_by_text(re.compile(r"^Peak: [\d,]+ bytes")).first
    text.wait_for(timeout=90_000)
    shown = int(re.match(r"Peak: ([\d,]+) bytes", text.inner_text()).group(1).replace(",", ""))
    assert shown == memory["peak_bytes"] == memory["timeline"]["peak_bytes"]
    peak_step = memory["timeline"]["steps"][memory["timeline"]["peak_step"]]
    assert peak_step["label"] in text.inner_text()
    # the timeline chart drew (Vega renders into a canvas or svg inside the tab)
    page.locator('[data-testid="stVegaLiteChart"]').first.wait_for(timeout=30_000)


def test_resnet_tiny_says_why_saved_and_held_is_above_the_activation_peak():
    from graphviz_core.ui.format import format_bytes

    capture = captured("resnet-tiny")
    saved_and_held = capture.memory.saved_bytes + capture.memory.checkpoint_held_bytes
    # The two figures measure different things: autograd saves each BatchNorm's running mean and variance (buffers of
    # the model, alive before the forward and after the step, as parameters are), while the timeline counts only the
    # storages the step creates. resnet-tiny has 20 BatchNorms over 8 + 4x8 + 5x16 + 5x32 + 5x64 = 600 channels (the
    # stem, then per stage 4 convolutions' norms plus a shortcut's from stage 1 on): 600 x 2 statistics x 4 bytes = 4,800
    assert saved_and_held > capture.timeline.activation_peak_bytes
    at = explorer_tab("Memory", 180, preset="resnet-tiny")
    assert not at.exception
    shown = {m.label: m.value for m in at.metric}
    assert shown["Saved + held"] == format_bytes(saved_and_held) == "141.5 KiB"
    # 140,584 B: the batch, saved activations and temporaries at the peak; BatchNorm's in-place num_batches_tracked
    # counters (20 x 8 B, buffers) are no temporaries (issue 33 item 9; they made it 140,744 B, "137.4 KiB")
    assert shown["Activation peak"] == format_bytes(capture.timeline.activation_peak_bytes) == "137.3 KiB"
    why = [c.value for c in at.caption if c.value.startswith("Saved + held is above the activation peak")]
    assert len(why) == 1 and f"autograd also saves {format_bytes(4800)} of tensors" in why[0], why


def test_no_explanation_where_saved_and_held_is_within_the_activation_peak():
    capture = captured("vit-tiny")  # no buffers saved: 109.8 KiB saved within a 117.1 KiB activation peak
    assert capture.memory.saved_bytes + capture.memory.checkpoint_held_bytes <= capture.timeline.activation_peak_bytes
    at = explorer_tab("Memory", 180, preset="vit-tiny")
    assert not at.exception
    assert not [c.value for c in at.caption if c.value.startswith("Saved + held is above")]


def test_the_policies_side_by_side_are_captured_through_the_shared_captures():
    """Issue 34 item 5: the checkpointing comparison asks the one job path the main capture uses (queued, limited,
    cancellable, cached for every session), not a capture of its own: after the click, the shared cache holds each
    policy's capture, and the table is a pure function of them (analysis.checkpointing.checkpointing_table)."""
    from graphviz_core.analysis.checkpointing import checkpointing_table, policy_configs
    from graphviz_core.serve.shared_captures import shared_captures

    at = explorer_tab("Memory", 180)
    next(b for b in at.button if b.label == "Compare the checkpointing policies").click().run()
    assert not at.exception
    config = at.session_state["config.applied"]
    configs = policy_configs(config, "meta")
    held = [shared_captures().lookup(c) for c in configs]
    assert all(h is not None for h in held), [c.checkpoint for c, h in zip(configs, held, strict=True) if h is None]
    table = checkpointing_table(config, "meta", config.optimizer, [h.capture for h in held])
    shown = next(d.value for d in at.dataframe if "held for recompute" in d.value.columns)
    assert list(shown["held for recompute"]) == [format_bytes(r.held_bytes) for r in table.rows]


def test_full_against_lora_is_captured_through_the_shared_captures():
    """Issue 34 item 5: full fine-tuning against LoRA asks the shared captures for both sides (finetune_configs), and
    the table is the pure finetune_table of them."""
    from graphviz_core.analysis.finetuning import finetune_configs, finetune_table
    from graphviz_core.serve.shared_captures import shared_captures

    at = explorer_tab("Memory", 180)
    next(b for b in at.button if b.label.startswith("Compare full fine\\-tuning with")).click().run()  # Markdown-escaped
    assert not at.exception
    config = at.session_state["config.applied"]
    held = [shared_captures().lookup(c) for c in finetune_configs(config)]
    assert all(h is not None for h in held)
    result = finetune_table(config, config.optimizer, held[0].capture, held[1].capture)
    assert result.tuned.trainable_parameters < result.full.trainable_parameters  # LoRA trains fewer
