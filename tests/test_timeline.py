"""The memory timeline against counts made without it: saved-tensor hooks, parameters and gradients, and
PyTorch's own MemTracker (torch.distributed._tools.mem_tracker) on the same model and batch."""

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from graphviz_core.capture.engine import capture_backward
from graphviz_core.capture.timeline import KINDS
from graphviz_core.config import config_from_preset
from graphviz_core.models.registry import build_model, compute_loss, make_batch
from tests.conftest import captured


def _storage_bytes(tensors) -> dict[int, int]:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


def test_forward_end_and_backward_end_equal_an_independent_count_on_the_mlp():
    config = config_from_preset("mlp", device="cpu")
    capture = capture_backward(config)
    timeline = capture.timeline
    # The same model and batch again, counted with nothing but a saved-tensor hook.
    model, batch = build_model(config), make_batch(config, "cpu")
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compute_loss(config, model(batch.inputs), batch.targets)
    params = _storage_bytes(model.parameters())
    # mlp: 2 x (fc 64x256 + 256, proj 256x64 + 64) = 66_176 fp32 scalars = 264_704 B
    assert sum(params.values()) == 2 * (64 * 256 + 256 + 256 * 64 + 64) * 4 == 264_704
    activations = {k: v for k, v in saved.items() if k not in params}
    batch_only = {k: v for k, v in _storage_bytes((batch.inputs, batch.targets)).items() if k not in activations}
    loss_bytes = loss.untyped_storage().nbytes()  # mse_loss's 0-d result keeps its (4, 8, 64) buffer: 8_192 B
    assert loss_bytes == 4 * 8 * 64 * 4
    forward_end = sum(params.values()) + sum(activations.values()) + sum(batch_only.values()) + loss_bytes
    assert timeline.steps[timeline.forward_end_step].total_bytes == forward_end
    end = timeline.steps[-1].bytes_by_kind
    # After backward: every saved activation is freed except the batch (which the caller still holds);
    # each parameter has a gradient of its own size.
    assert end[KINDS.index("gradients")] == sum(params.values())
    assert (
        sum(end) == 2 * sum(params.values()) + sum(_storage_bytes((batch.inputs, batch.targets)).values()) + loss_bytes
    )
    assert capture.memory.peak_bytes == timeline.peak_bytes >= forward_end


def _memtracker_peak(config) -> int:
    model, batch = build_model(config), make_batch(config, "cpu")
    tracker = MemTracker()
    tracker.track_external(model, batch.inputs, batch.targets)
    with tracker:
        loss = compute_loss(config, model(batch.inputs), batch.targets)
        loss.backward()
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    return snapshot["Total"]


def test_peak_equals_memtrackers_peak_on_mlp_and_gpt2_with_every_checkpoint_policy():
    for preset, checkpoint in (("mlp", "none"), ("mlp", "full"), ("gpt2-tiny", "none"), ("gpt2-tiny", "selective")):
        config = config_from_preset(preset, device="cpu", checkpoint=checkpoint)
        assert capture_backward(config).memory.peak_bytes == _memtracker_peak(config), (preset, checkpoint)


def test_saved_and_held_bytes_at_the_end_of_the_forward_match_the_capture():
    for checkpoint in ("none", "full", "selective"):
        capture = captured("gpt2-tiny", checkpoint=checkpoint)
        at_end = capture.timeline.steps[capture.timeline.forward_end_step].bytes_by_kind
        assert at_end[KINDS.index("saved activations")] == capture.memory.saved_bytes
        assert at_end[KINDS.index("held for recompute")] == capture.memory.checkpoint_held_bytes
    # full: each of the 2 blocks holds its (2, 32, 64) fp32 input = 2 * 16_384 B
    assert captured("gpt2-tiny", checkpoint="full").memory.checkpoint_held_bytes == 2 * 2 * 32 * 64 * 4


def test_steps_are_forward_ops_then_backward_nodes_in_engine_order_and_the_peak_is_named():
    capture = captured("gpt2-tiny")
    steps = capture.timeline.steps
    backward = [s.label for s in steps if s.phase == "backward"][1:]  # after "backward starts"
    assert backward == list(capture.backward_order)
    assert [s.phase for s in steps[: capture.timeline.forward_end_step + 1]][1:] == [
        "forward"
    ] * capture.timeline.forward_end_step
    assert {s.module for s in steps if s.phase == "forward"} >= {"wte", "blocks.0.attn.qkv", "lm_head"}
    peak = capture.timeline.peak
    assert peak.total_bytes == capture.memory.peak_bytes
    assert peak.label in capture.graph or peak.phase == "forward"


def test_meta_and_cpu_timelines_agree_and_peak_is_never_null():
    cpu = captured("gpt2-tiny")
    meta = captured("gpt2-tiny", device="meta")
    assert meta.memory.peak_bytes is not None and meta.memory.peak_bytes > 0
    # same shapes, same storages: the fused-attention kernel on meta is the CPU one (capture mirrors it)
    assert meta.memory.peak_bytes == cpu.memory.peak_bytes


def test_cli_json_has_the_timeline_under_memory_timeline_and_a_peak(tmp_path):
    import json

    from graphviz_core.cli import main

    out = tmp_path / "g.json"
    assert main(["graph", "--preset", "gpt2-tiny", "--device", "meta", "-o", str(out)]) == 0
    memory = json.loads(out.read_text())["memory"]
    timeline = memory["timeline"]
    assert timeline["kinds"] == list(KINDS)
    peak = timeline["steps"][timeline["peak_step"]]
    assert memory["peak_bytes"] == timeline["peak_bytes"] == peak["total_bytes"] == sum(peak["bytes"])
    assert memory["peak_bytes"] == captured("gpt2-tiny").memory.peak_bytes  # meta = cpu (same storages)
    assert memory["training_step"]["optimizer"] == "adamw"


def test_a_buffer_updated_in_place_is_no_temporary():
    """Issue 33 item 9: a peak leaves module buffers out. BatchNorm's num_batches_tracked.add_(1) returns the buffer's
    own storage; counted as a new temporary it put 8 B per BatchNorm (resnet-tiny: 20 x 8 = 160 B) into every peak.
    A layer that counts its calls in an int64 buffer, as BatchNorm does, has the timeline of the same layer counting
    nothing, minus the counting op's own step."""
    from graphviz_core.capture.own_module import capture_module

    class Counting(torch.nn.Module):
        def __init__(self, count: bool) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 16)
            self.count = count
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            if self.count:
                self.calls.add_(1)
            return self.linear(x)

    def timeline(count: bool):
        torch.manual_seed(0)
        capture = capture_module(Counting(count), (torch.randn(4, 8),), lambda out: out.square().mean())
        assert capture.memory.buffer_bytes == 8  # one int64
        return [(s.label, s.total_bytes) for s in capture.timeline.steps]

    counting = timeline(True)
    assert ("add_.Tensor", counting[1][1]) in counting  # the count ran, and held no new bytes
    assert [s for s in counting if s[0] != "add_.Tensor"] == timeline(False)
