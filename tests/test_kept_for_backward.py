"""The memory headline a user compares across checkpoint policies: kept_for_backward_bytes, what the forward leaves
alive for backward (tensors saved for it + what checkpointing holds to recompute the rest). Saved bytes alone read
the same for full and selective checkpointing, because a checkpoint keeps its region's tensors itself."""

from __future__ import annotations

import json

from graphviz_core.analysis.checkpointing import compare_checkpointing, policy_memory
from graphviz_core.analysis.memory_report import memory_report
from graphviz_core.config import config_from_preset
from graphviz_core.export.formats import capture_to_dict
from tests.conftest import captured

# qwen2-tiny: 2 layers, h=64, b=2, s=32, float32, head size 16.
LAYER_INPUT = 2 * 32 * 64 * 4  # (b, s, h) float32 = 16_384 B
ROTARY = 2 * (1 * 32 * 16 * 4)  # cos and sin, (1, s, head size) float32 each = 2 * 2_048
POSITION_IDS = 1 * 32 * 8  # (1, s) int64 = 256


def test_full_checkpointing_keeps_each_layers_inputs_and_the_headline_counts_them():
    none, full = captured("qwen2-tiny"), captured("qwen2-tiny", checkpoint="full")
    # each checkpointed layer holds its hidden-state input; cos, sin and the position ids are one storage each,
    # shared by both layers (held once): 2 * 16_384 + 4_096 + 256 = 37_120
    assert full.memory.checkpoint_held_bytes == 2 * LAYER_INPUT + ROTARY + POSITION_IDS == 37_120
    assert full.memory.kept_for_backward_bytes == full.memory.saved_bytes + 37_120
    assert none.memory.kept_for_backward_bytes == none.memory.saved_bytes  # nothing held without checkpointing


def test_selective_saves_what_full_saves_and_the_headline_tells_them_apart():
    full = captured("qwen2-tiny", checkpoint="full").memory
    selective = captured("qwen2-tiny", checkpoint="selective").memory
    # Outside the checkpointed layers both save the same (embedding, final norm, head, loss) ...
    assert selective.saved_bytes == full.saved_bytes
    # ... and what selective keeps besides (the outputs of its kept ops) is in the headline
    assert selective.kept_for_backward_bytes == selective.saved_bytes + selective.checkpoint_held_bytes
    assert selective.kept_for_backward_bytes > full.kept_for_backward_bytes


def test_the_headline_leads_the_graph_json_the_memory_json_and_the_checkpoint_rows():
    capture = captured("qwen2-tiny", checkpoint="full")
    memory = json.loads(json.dumps(capture_to_dict(capture)))["memory"]
    assert next(iter(memory)) == "kept_for_backward_bytes"
    assert memory["kept_for_backward_bytes"] == memory["saved_bytes"] + memory["checkpoint_held_bytes"]
    report = memory_report(config_from_preset("qwen2-tiny", checkpoint="full"))
    assert list(report)[2] == "kept_for_backward_bytes"  # after config and device
    assert report["kept_for_backward_bytes"] == capture.memory.kept_for_backward_bytes
    row = policy_memory(capture)
    assert row.kept_for_backward_bytes == capture.memory.kept_for_backward_bytes
    table = compare_checkpointing(config_from_preset("gpt2-tiny"))
    assert all(r.kept_for_backward_bytes == r.saved_bytes + r.held_bytes for r in table.rows)
