"""The long work the pages ask for besides one capture, each as a `Work` for the shared store
(graphviz_core.serve.shared_captures.SharedCaptures.request_work): queued through admission, stopped by its ticket
(Cancel, the last waiter gone, the server's run time limit), cached for every session under the store's limits.

- `simulation`: one parallel layout (graphviz_core.parallel.pipeline.simulate_layout), in admission's simulation
  queue; it stops at its next op.
- `planning`: a plan of every layout (graphviz_core.parallel.planner.plan), in the same queue, as one request; it
  stops at the next op of the layout it simulates and reports each layout simulated.
- `fit_search`: will-it-fit's bisection (graphviz_core.analysis.fit.will_it_fit), each meta capture through
  admission's meta queue (a worker process where the pool is up) with the search's ticket.
- `debugging`: the Debug tab's step under the gradient-flow watch (graphviz_core.analysis.gradient_flow.debug_step),
  admitted on its device as a capture is (its memory reserved, its queue, the run time limit); one step, stopped
  while it waits, not in the middle.

Each returns a pair (key, work): the key names everything the result depends on.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from graphviz_core.analysis.fit import FitSearch, will_it_fit
from graphviz_core.analysis.gradient_flow import debug_step
from graphviz_core.capture.admission import SIMULATION, Ticket, admit
from graphviz_core.capture.device import resolve_device
from graphviz_core.capture.result import Capture
from graphviz_core.capture.workers import capture_anywhere
from graphviz_core.config import ModelConfig
from graphviz_core.parallel.pipeline import simulate_layout
from graphviz_core.parallel.planner import Cluster, Plan, plan
from graphviz_core.parallel.settings import ParallelConfig
from graphviz_core.parallel.world import stopped_by
from graphviz_core.serve.shared_captures import Work

Progress = Callable[..., None]


def simulation(config: ModelConfig, parallel: ParallelConfig) -> tuple[Hashable, Work]:
    """`config` laid out as `parallel`: rank 0's PerRank (with every pipeline stage)."""

    def work(progress: Progress, ticket: Ticket):
        with admit(config, SIMULATION, ticket), stopped_by(ticket):
            progress("simulating the ranks with torch.distributed over a fake process group")
            return simulate_layout(config, parallel)

    return ("simulation", config, parallel), work


def planning(config: ModelConfig, cluster: Cluster, global_batch: int, checkpoints: tuple[str, ...],
             microbatch_sizes: tuple[int, ...], pp_degrees: tuple[int, ...], cp_degrees: tuple[int, ...],
             cp_with_pp: bool) -> tuple[Hashable, Work]:
    """Every layout of `config` on `cluster`, simulated one after the other in this process, ranked."""
    asked = (global_batch, tuple(checkpoints), tuple(microbatch_sizes), tuple(pp_degrees), tuple(cp_degrees),
             cp_with_pp)

    def work(progress: Progress, ticket: Ticket) -> Plan:
        def each(done: int, total: int, what: str) -> None:
            progress(f"simulated {done} of {total} layouts; last: {what}", done / max(total, 1))

        with admit(config, SIMULATION, ticket), stopped_by(ticket):
            progress("enumerating the layouts", 0.0)
            return plan(config, cluster, global_batch, checkpoints, microbatch_sizes, pp_degrees, jobs=1,
                        progress=each, cp_degrees=cp_degrees, cp_with_pp=cp_with_pp)

    return ("plan", config, cluster, asked), work


def fit_search(config: ModelConfig, budget_bytes: int, optimizer: str, parameter_count: int | None,
               frozen_parameter_count: int) -> tuple[Hashable, Work]:
    """The largest batch and seq within `budget_bytes`, per checkpoint policy, by meta captures."""

    def work(progress: Progress, ticket: Ticket) -> FitSearch:
        captures = 0

        def capture(probe: ModelConfig) -> Capture:
            nonlocal captures
            captures += 1
            return capture_anywhere(probe, ticket=ticket)

        def each(what: str) -> None:
            progress(f"{what} ({captures} meta captures so far)")

        return will_it_fit(config, budget_bytes, optimizer, parameter_count=parameter_count, progress=each,
                           frozen_parameter_count=frozen_parameter_count, capture=capture)

    return ("fit", config, budget_bytes, optimizer, parameter_count, frozen_parameter_count), work


def debugging(config: ModelConfig, check_forward: bool) -> tuple[Hashable, Work]:
    """The findings of `config`'s step run under the gradient-flow watch, and the recorded graph of each backward."""

    def work(progress: Progress, ticket: Ticket):
        with admit(config, resolve_device(config.device), ticket):
            progress("running the step under the gradient-flow watch")
            return debug_step(config, check_forward)

    return ("debug", config, check_forward), work
