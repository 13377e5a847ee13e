"""Which differing fields come with a change of model and which the user set: compare_reasons.starting_point and
came_with_model on configs, then the sentences of a real capture pair (gpt2-tiny against bert-tiny)."""

from graphviz_core.analysis.compare import compare_captures
from graphviz_core.analysis.compare_reasons import came_with_model, starting_point
from graphviz_core.capture.engine import capture_backward
from graphviz_core.config import config_from_preset
from tests.conftest import captured


def test_a_changed_preset_starts_from_the_preset_it_differs_least_from():
    """The form drops a preset's name once a field changes, so the preset is found again from the fields."""
    bert_16 = config_from_preset("bert-tiny").replace(seq=16, preset="")
    assert starting_point(bert_16)["seq"] == 32  # bert-tiny's seq (config._tiny): 16 is the user's
    # llama-3.1-8b at s=4096 differs from llama-3.1-8b in 1 field (seq 8192), from llama-tiny in 10 (hidden, heads,
    # layers, vocab, batch, seq, kv_heads, intermediate, device, dtype)
    llama = config_from_preset("llama-3.1-8b").replace(seq=4096, preset="")
    assert starting_point(llama)["hidden"] == 4096 and starting_point(llama)["seq"] == 8192
    # the CLI keeps the preset's name with overrides (--preset bert-tiny --seq 16): that preset, not a guess
    assert starting_point(config_from_preset("bert-tiny", seq=16))["seq"] == 32


def test_only_fields_both_presets_set_come_with_the_model():
    gpt2 = config_from_preset("gpt2-tiny")
    bert_16 = config_from_preset("bert-tiny").replace(seq=16, preset="")
    # bert-tiny's context 64 and intermediate 256 against gpt2-tiny's 0 and 0 (the defaults): both presets' values
    assert came_with_model(gpt2, bert_16, "context") and came_with_model(gpt2, bert_16, "intermediate")
    # gpt2-tiny's seq is 32 and so is bert-tiny's: 32 -> 16 is the user's
    assert not came_with_model(gpt2, bert_16, "seq")
    # the same on A's side: gpt2-tiny at seq 16 against bert-tiny (32) is A's own change
    assert not came_with_model(gpt2.replace(seq=16, preset=""), config_from_preset("bert-tiny"), "seq")


def test_a_seq_set_on_the_other_model_gets_its_own_sentence():
    """gpt2-tiny against bert-tiny with seq 16: fields that differ are model, seq 32 -> 16, context 0 -> 64 and
    intermediate 0 -> 256; only context and intermediate come with BERT (bert-tiny's preset sets them), seq was set by
    the user and says what seq does. B is as the form hands it over: no longer exactly bert-tiny, so unnamed."""
    b = capture_backward(config_from_preset("bert-tiny").replace(seq=16, preset=""))
    c = compare_captures(captured("gpt2-tiny"), b)
    model, seq = c.explanations
    assert model.startswith("model gpt2 → bert: a different architecture")
    assert (
        "Also changed: context 0 → 64, intermediate 0 → 256; these come with the other architecture, and the "
        "totals above are not split among them." in model
    )
    assert "Not from the architecture: seq 32 → 16" in model
    assert seq == (
        "seq 32 → 16: no node added or removed — the graph's shape does not depend on seq; the activations saved "
        "for backward and the FLOPs scale with it."
    )


def test_a_layer_count_set_on_the_other_model_does_not_borrow_a_per_layer_count():
    """bert-tiny at 3 layers against gpt2-tiny (2): a gpt2 block has 43 nodes, a BERT layer another count, so the
    layer sentence claims no '+1 layer × 43 nodes'."""
    c = compare_captures(captured("gpt2-tiny"), captured("bert-tiny", layers=3))
    layers = next(s for s in c.explanations if s.startswith("3 layers instead of 2"))
    assert "43" not in layers and "not split per layer" in layers
    assert not any(s.startswith("All ") for s in c.explanations)  # the model's sentence gave the totals once


def test_the_page_gives_exact_byte_counts_the_cards_unit_too():
    from graphviz_core.ui.compare_view import with_binary_units

    # 694,020 B / 1024 = 677.75 KiB; 5,980 / 1024 = 5.84; under 1 KiB stays bytes alone
    assert with_binary_units("Saved 694,020 B → 700,000 B (+5,980 B; 512 B both)") == (
        "Saved 694,020 B (677.8 KiB) → 700,000 B (683.6 KiB) (+5,980 B (+5.8 KiB); 512 B both)")
