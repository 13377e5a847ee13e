"""The pages' long work besides a capture (graphviz_core.serve.work), run as captures are: through the shared store
(one job per request, shared by its waiters, cached), queued in admission, and stopped by its ticket mid-run (Cancel,
the last waiter gone, the server's run time limit) with nothing left behind for the next run."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from graphviz_core.analysis.fit import will_it_fit
from graphviz_core.capture.admission import CaptureCancelled, Ticket
from graphviz_core.config import config_from_preset, resolve_config
from graphviz_core.parallel.planner import Cluster
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.serve import work
from graphviz_core.serve.shared_captures import Job, SharedCaptures

LLAMA = resolve_config("llama-tiny", layers=2)
FSDP2 = ParallelConfig("fsdp", 2)
PP2 = ParallelConfig("fsdp", 4, pp=2, microbatches=2)


class StopAt(Ticket):
    """A real admission ticket that cancels itself at its `at`-th check (None: never), counting checks: a simulation
    checks its ticket at every op it dispatches, in whichever rank's thread runs it."""

    def __init__(self, at: int | None = None) -> None:
        super().__init__()
        self.at, self.checks = at, 0

    def check(self) -> None:
        self.checks += 1
        if self.checks == self.at:
            self.cancel("stopped by the test")
        super().check()


def _figures(result) -> tuple:
    """What a simulation reports, its time left out."""
    ranks = list(result.pipeline.ranks) if result.pipeline else [result]
    return tuple((r.peak_bytes, r.phases, r.collectives, r.gradient_bytes, r.optimizer_bytes) for r in ranks)


@pytest.mark.parametrize("parallel", [FSDP2, PP2, ParallelConfig("fsdp+tp", 4, tp=2, sequence_parallel=True),
                                      ParallelConfig("fsdp", 4, cp=2)],
                         ids=["fsdp 2", "fsdp 2 x pp 2 (rank threads)", "fsdp 2 x tp 2 + sp", "fsdp 2 x cp 2"])
def test_a_simulation_stopped_mid_step_raises_and_leaves_nothing_for_the_next(parallel):
    """A whole run counts its checks; a second is stopped at half of them (mid-step: every op checks, and the pipeline's
    ops run in its rank threads). It raises CaptureCancelled, no process group is left, and the next run of the same
    layout reports what the first did. (Stopped at every 31st check of these four layouts and of pp 2 x cp 2, by hand:
    each raised at its check, none ended the process, the next run equal. Raising at prim.device, which autograd's C++
    reads while it records an op, ended the process; inside DTensor's sharding propagation it came out as a
    RuntimeError: neither is checked now.)"""
    _, simulate = work.simulation(LLAMA, parallel)
    counted = StopAt()
    first = simulate(lambda *a: None, counted)
    assert counted.checks > 100, counted.checks  # one per op at least
    stopped = StopAt(at=counted.checks // 2)
    with pytest.raises(CaptureCancelled, match="stopped by the test"):
        simulate(lambda *a: None, stopped)
    assert stopped.checks == counted.checks // 2  # it stopped at that check, not at the end
    assert not dist.is_initialized()
    again = simulate(lambda *a: None, Ticket())
    assert _figures(again) == _figures(first)


def test_a_plan_stopped_mid_run_is_stopped_not_a_skipped_layout():
    """The planner turns a failed layout into a `skipped` entry; a stop is not a failure: the plan itself raises."""
    _, planning = work.planning(LLAMA, Cluster(gpus=2, gpu_memory_bytes=2**40, gpus_per_node=2), 4, ("none",), (1,),
                                (1,), (1,), False)
    stopped = StopAt(at=500)
    with pytest.raises(CaptureCancelled):
        planning(lambda *a: None, stopped)
    assert stopped.checks == 500


def test_the_servers_run_time_limit_stops_a_plan(monkeypatch):
    """GRAPHVIZ_CORE_RUN_TIMEOUT_S counts against a plan as against a capture: 0.05 s, and a plan of several layouts
    (each over a second here) stops at the first check after it, with the limit's sentence."""
    monkeypatch.setenv("GRAPHVIZ_CORE_RUN_TIMEOUT_S", "0.05")
    _, planning = work.planning(LLAMA, Cluster(gpus=2, gpu_memory_bytes=2**40, gpus_per_node=2), 4, ("none", "full"),
                                (1,), (1, 2), (1,), False)
    with pytest.raises(CaptureCancelled, match="run time limit of 0.05 s"):
        planning(lambda *a: None, Ticket())


def _done(job: Job):
    assert job.done.wait(300)
    return job


def test_two_sessions_share_one_simulation_and_the_next_ask_finds_it_cached():
    store = SharedCaptures()
    key, simulate = work.simulation(LLAMA, FSDP2)
    first = store.request_work(key, "session-1", simulate, "the simulation")
    second = store.request_work(work.simulation(LLAMA, FSDP2)[0], "session-2", simulate, "the simulation")
    assert isinstance(first, Job) and second is first and first.waiters == {"session-1", "session-2"}
    result = _done(first).result
    assert first.error is None and result.value.peak_bytes > 0
    assert store.lookup_key(key) is result  # cached under the same key: asked again, no run
    assert store.request_work(key, "session-3", simulate, "the simulation") is result
    assert store.lookup_key(work.simulation(LLAMA, ParallelConfig("fsdp", 4))[0]) is None  # another layout


def test_a_simulation_its_last_waiter_leaves_is_cancelled():
    store = SharedCaptures()
    key, simulate = work.simulation(LLAMA, PP2)
    job = store.request_work(key, "session-1", simulate, "the simulation")
    assert store.withdraw(job, "session-1")
    _done(job)
    assert isinstance(job.error, CaptureCancelled) and store.lookup_key(key) is None
    assert store.in_flight_key(key) is None


def test_the_fit_search_runs_its_captures_with_its_ticket_and_finds_what_will_it_fit_finds():
    """Every meta capture of the search goes through admission with the search's ticket (a cancelled ticket stops the
    first); not cancelled, the answer is will_it_fit's own."""
    config = config_from_preset("mlp", device="cpu")
    budget = 64 * 2**10
    _, search = work.fit_search(config, budget, "adamw", None, 0)
    cancelled = Ticket()
    cancelled.cancel("cancelled by the test")
    with pytest.raises(CaptureCancelled, match="cancelled by the test"):
        search(lambda *a: None, cancelled)
    phases = []
    got = search(lambda phase, *a: phases.append(phase), Ticket())
    assert [dataclasses.astuple(r) for r in got.results] == [
        dataclasses.astuple(r) for r in will_it_fit(config, budget, "adamw").results]
    assert phases and all("meta captures so far" in p for p in phases)


def test_no_simulation_leaves_its_exception_hook_behind():
    """torch's init_process_group wraps sys.excepthook ("[rank0]: " before every line) and destroying the group
    leaves it: three simulations nested three hooks, and a server's next uncaught error read "[rank0]: [rank0]:
    [rank0]: Traceback". The hook the process had is the hook it has after any number of simulations."""
    import sys

    before = sys.excepthook
    _, simulate = work.simulation(LLAMA, FSDP2)
    for _ in range(2):
        simulate(lambda *a: None, Ticket())
    with pytest.raises(CaptureCancelled):
        simulate(lambda *a: None, StopAt(at=300))
    assert sys.excepthook is before


def test_a_comparison_is_kept_in_the_shared_store_counted_with_the_captures_it_holds():
    """The compare page's comparison of two captures lives in the one store too: asked again, the same object, not
    compared again; its retained bytes include both captures' (it holds them), so the store's limit is never passed
    by what comparisons keep alive."""
    from graphviz_core.serve.shared_captures import retained_bytes, shared_captures
    from graphviz_core.ui.compare_view import get_comparison
    from tests.conftest import captured

    a, b = captured("mlp"), captured("gpt2-tiny")
    first = get_comparison(a, b)
    assert get_comparison(a, b) is first
    kept = shared_captures().lookup_key(("comparison", a.config, b.config, id(a), id(b)))
    assert kept is not None and kept.value is first
    assert kept.retained_bytes == retained_bytes(first) > max(retained_bytes(a), retained_bytes(b))
