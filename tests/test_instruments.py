"""The capture's instruments are observers: a capture runs only those asked for, each fills its own fields, and a new
one is a new class registered beside the others."""

import pytest

from graphviz_core.capture import engine
from graphviz_core.capture.engine import GRAPH_ONLY, INSTRUMENTS, capture_backward
from graphviz_core.capture.instrument import Instrument
from graphviz_core.config import config_from_preset

STRUCTURE = ("op", "category", "module", "param", "recomputed")  # what module attribution and the walk decide


# torch's reshape takes `_reshape_alias` (ReshapeAliasBackward0) unless a Python dispatch mode is active, when it takes
# `view` (ViewBackward0): the instruments that watch aten ops bring such a mode, the graph alone does not. Same node,
# same count, both `shape`; its name follows the mode.
ALIAS = ("ReshapeAliasBackward0", "ViewBackward0")


def structure(capture, alias: bool = False):
    def name(text: str) -> str:
        return text.replace(*ALIAS) if alias else text

    return ({name(n): tuple(name(str(d[k])) for k in STRUCTURE) for n, d in capture.graph.nodes(data=True)},
            sorted((name(u), name(v)) for u, v in capture.graph.edges()))


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_the_graph_alone_has_the_full_captures_nodes_edges_categories_and_modules(preset):
    config = config_from_preset(preset, device="cpu")
    full = capture_backward(config)
    alone = capture_backward(config, instruments=GRAPH_ONLY)
    assert structure(alone, alias=True) == structure(full)
    assert alone.summary.nodes == full.summary.nodes and alone.summary.edges == full.summary.edges
    assert alone.summary.by_category == full.summary.by_category
    renamed = alone.summary.by_op.get(ALIAS[0], 0)
    assert renamed == full.summary.by_op.get(ALIAS[1], 0) - alone.summary.by_op.get(ALIAS[1], 0)
    # Nothing else was measured: the schema's neutral values, and no timeline.
    values = [d for _, d in alone.graph.nodes(data=True)]
    assert {d["saved_bytes"] for d in values} == {0} and {d["flops"] for d in values} == {0}
    assert {d["time_s"] for d in values} == {None} and {d["grad_norm"] for d in values} == {None}
    assert alone.timeline is None and alone.save_order == () and alone.backward_order == ()
    assert alone.flops.backward == 0 and alone.memory.saved_bytes == 0
    # ... while the full capture measured them.
    assert full.memory.saved_bytes > 0 and full.flops.backward > 0 and full.timeline is not None


def test_each_instrument_fills_only_its_own_fields():
    config = config_from_preset("gpt2-tiny", device="cpu")
    full = capture_backward(config)
    flops_only = capture_backward(config, instruments={"flops"})  # reads the backward order: "order" comes with it
    assert flops_only.flops == full.flops
    assert flops_only.backward_order == full.backward_order
    assert flops_only.memory.saved_bytes == 0 and flops_only.timeline is None
    timeline_only = capture_backward(config, instruments={"timeline"})  # reads the saved tensors: "saved" comes too
    assert timeline_only.timeline.peak_bytes == full.timeline.peak_bytes
    assert timeline_only.memory.saved_bytes == full.memory.saved_bytes
    assert timeline_only.flops.backward == 0


def test_an_unknown_instrument_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown instrument.*choose from saved, order"):
        capture_backward(config_from_preset("mlp", device="cpu"), instruments={"speed"})


class _CountsNodes(Instrument):
    """A new instrument: how many node backwards ran, and which node each module call's forward ended in."""

    name = "count"

    def start(self, run):
        super().start(run)
        self.ran = 0
        self.calls = 0

    def module_post(self, module, path):
        self.calls += 1

    def node_pre(self, node_id):
        self.ran += 1

    def annotate(self, node_id, record):
        record["counted_by_test"] = True


def test_a_new_instrument_is_one_class_registered_beside_the_others(monkeypatch):
    seen = []
    original = _CountsNodes.release
    monkeypatch.setattr(_CountsNodes, "release", lambda self: (seen.append((self.ran, self.calls)), original(self)))
    monkeypatch.setitem(INSTRUMENTS, "count", _CountsNodes)
    capture = capture_backward(config_from_preset("mlp", device="cpu"), instruments={"count"})
    # mlp preset: 2 layers of fc -> GELU -> proj; its graph has these nodes, each run once by the engine (no
    # checkpointing), so every node reached from the loss ran exactly one backward.
    ran, calls = seen[0]
    assert ran == capture.summary.nodes
    # Module calls in the forward: MLP, its ModuleList is not called, 2 x (FeedForward, fc, act, proj) = 1 + 2 * 4.
    assert calls == 1 + 2 * 4
    assert all(d["counted_by_test"] for _, d in capture.graph.nodes(data=True))


def test_a_graph_only_capture_installs_no_dispatch_mode(monkeypatch):
    made = []
    original = engine._OpObserver.__init__

    def spy(self, *args, **kwargs):
        made.append(args)
        original(self, *args, **kwargs)

    monkeypatch.setattr(engine._OpObserver, "__init__", spy)
    capture_backward(config_from_preset("mlp", device="cpu"), instruments=GRAPH_ONLY)
    assert made == []
    capture_backward(config_from_preset("mlp", device="cpu"), instruments={"flops"})
    assert len(made) == 2  # forward and backward
