"""Which layer a parallel simulation's memory sample is filed under (graphviz_core.parallel.memory.PhasePeaks): the
planner scales each layer's peak by its position, so the answer must not change from one process to the next."""

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
