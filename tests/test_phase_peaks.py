"""Which layer a parallel simulation's memory sample, and which module its collective, is filed under (PhasePeaks,
CollectiveRecorder): the planner scales each layer's peak by its position, and the Communication table files traffic
by module, so neither answer may change from one process to the next."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from graphviz_core.parallel.memory import PhasePeaks


def _peaks_in(order: list[str], phase: str) -> str:
    """The segment PhasePeaks files a sample under when torch's module tracker holds the names in `order` (its
    `parents` is a set: the order it iterates in follows string hashes, different in every process)."""
    layers = [nn.Linear(1, 1) for _ in range(3)]
    known = {module: f"Stage.layers.{i}" for i, module in enumerate(layers)}
    tracker = SimpleNamespace(_mod_tracker=SimpleNamespace(parents=order, _known_modules=known), _curr_mem_snap={})
    peaks = PhasePeaks(tracker, layers)
    peaks.phase = phase
    return peaks._segment()


@pytest.mark.parametrize("order", [["Global", "Stage", "Stage.layers.1", "Stage.layers.2"],
                                   ["Stage.layers.2", "Stage.layers.1", "Stage", "Global"]])
def test_two_layers_held_at_once_file_under_the_one_running(order):
    """Layer 2's backward began and layer 1's has not been seen to end (or, in forward, layer 1 not yet seen to end
    when layer 2 began): backward runs the layers in reverse, so the step is in layer 1 in backward and layer 2 in
    forward, whichever order the set gives. Before, the first name iterated won: a fresh-clone run planned a pipeline
    with context parallel 36,992 B above its full simulation (one layer's backward peak filed under its neighbour),
    in about one process in three."""
    assert _peaks_in(order, "backward") == "layer 1"
    assert _peaks_in(order, "forward") == "layer 2"


def test_outside_the_layers_a_sample_is_before_or_after_them():
    assert _peaks_in(["Global", "Stage"], "forward") == "pre"


@pytest.mark.parametrize("order", [["Global", "Stack", "Stack.layers", "Stack.layers.1", "Stack.layers.1.0",
                                    "Stack.layers.2", "Stack.layers.2.1"],
                                   ["Stack.layers.2.1", "Stack.layers.2", "Stack.layers.1.0", "Stack.layers.1",
                                    "Stack.layers", "Stack", "Global"]])
def test_a_collective_is_filed_under_the_module_running(order):
    """The same for the collective recorder's module: layer 1's first linear (`layers.1.0`) and layer 2's second
    (`layers.2.1`) held at once. The old rule, the deepest path and then the longest, tied these two and took the
    first the set gave."""
    from graphviz_core.parallel.collectives import CollectiveRecorder

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)) for _ in range(3))

    model = Stack()
    recorder = CollectiveRecorder({})
    recorder.modules._get_mod_name(model)  # torch's ModTracker names the model's modules, in the model's order
    recorder.modules.parents = order
    recorder.phase = "backward"
    assert recorder._innermost() == "layers.1.0"
    recorder.phase = "forward"
    assert recorder._innermost() == "layers.2.1"
