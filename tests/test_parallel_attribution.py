"""Each collective is filed under the module that caused it (issue 33 item 5): context parallel's ring collectives in
backward belong to the layer whose attention node issued them, not to the last layer."""

from __future__ import annotations

import json
from collections import Counter

from graphviz_core.cli import main
from graphviz_core.config import resolve_config
from graphviz_core.parallel.pipeline import simulate_layout
from graphviz_core.parallel.settings import ParallelConfig

FLAGS = ["--preset", "llama-tiny", "--layers", "3", "--hidden", "96", "--kv-heads", "2", "--intermediate", "128",
         "--batch", "3", "--seq", "48", "--device", "cpu"]


def _ring(collectives, phase: str) -> Counter:
    return Counter((c["module"], c["kind"]) for c in collectives if c["group"] == "cp" and c["phase"] == phase)


def test_the_cli_json_files_each_layers_backward_ring_under_that_layer(tmp_path):
    """FSDP over 4 ranks, CP 2, 3 layers. torch's ring (context.py) all-gathers a layer's keys and values once in
    its attention's forward; in backward once again, and passes the key/value gradients on by all-to-all C = 2
    times. Before the fix all 9 backward ones read layers.2.self_attn."""
    out = tmp_path / "cp.json"
    assert main(["graph", *FLAGS, "--strategy", "fsdp", "--world-size", "4", "--cp", "2", "-o", str(out)]) == 0
    collectives = json.loads(out.read_text())["per_rank"]["collectives"]
    layers = [f"model.layers.{i}.self_attn" for i in range(3)]
    assert _ring(collectives, "forward") == Counter({(m, "all_gather"): 1 for m in layers})
    assert _ring(collectives, "backward") == Counter(
        {**{(m, "all_gather"): 1 for m in layers}, **{(m, "all_to_all"): 2 for m in layers}})


def test_inside_a_pipeline_each_stages_layers_keep_their_ring():
    """pp 2 x FSDP 2 x CP 2, 3 microbatches: stage 0 holds layers 0 and 1 (stage_bounds: 3 layers, the earlier stage
    takes the extra one); each of its layers runs the ring once per microbatch in forward (one all-gather) and in
    backward (one all-gather, two all-to-alls)."""
    config = resolve_config("llama-tiny", layers=3, hidden=96, kv_heads=2, intermediate=128, batch=3, seq=48,
                            device="cpu")
    result = simulate_layout(config, ParallelConfig("fsdp", 8, pp=2, microbatches=3, cp=2), single_device=False)
    ring = Counter((c.module, c.kind) for c in result.collectives if c.group == "cp" and c.phase == "backward")
    layers = [f"model.model.layers.{i}.self_attn" for i in range(2)]
    assert ring == Counter({**{(m, "all_gather"): 3 for m in layers}, **{(m, "all_to_all"): 6 for m in layers}})
