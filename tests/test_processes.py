"""Meta dry runs in other processes (graphviz_core.capture.workers): the same Capture as in this process, from the fork
server's pool and from a forked child, a cancelled wait that returns at once, and a dead worker that is replaced."""

from __future__ import annotations

import os
import signal
import time

import networkx as nx
import pytest

from graphviz_core.capture import workers as processes
from graphviz_core.capture.admission import CaptureCancelled, Ticket
from graphviz_core.capture.engine import capture_backward
from graphviz_core.capture.result import Capture
from graphviz_core.config import config_from_preset

POOL_START_S = 120  # the fork server imports torch and every family's transformers modules: ~4 s here, more under load


def same(a: Capture, b: Capture) -> None:
    """Everything a capture reports, field by field; the graph node by node (meta captures have no times)."""
    assert a.config == b.config and a.device == b.device == "meta"
    assert (a.summary, a.memory, a.flops, a.time, a.loss) == (b.summary, b.memory, b.flops, b.time, b.loss)
    assert nx.utils.graphs_equal(a.graph, b.graph)
    assert a.save_order == b.save_order and a.backward_order == b.backward_order
    assert a.timeline == b.timeline


@pytest.fixture(scope="module")
def pool():
    if not processes.wait_for_pool(POOL_START_S):
        pytest.fail(f"the meta worker processes did not answer within {POOL_START_S} s")


def test_meta_runs_go_elsewhere_and_nothing_else(monkeypatch):
    assert processes.runs_elsewhere(config_from_preset("llama-tiny", device="meta"))
    monkeypatch.setenv("GRAPHVIZ_CORE_DEVICE", "meta")
    assert processes.runs_elsewhere(config_from_preset("gpt2-tiny"))  # auto resolves to meta
    monkeypatch.setenv("GRAPHVIZ_CORE_DEVICE", "cpu")
    assert not processes.runs_elsewhere(config_from_preset("gpt2-tiny"))  # timed: stays here
    monkeypatch.setenv(processes.PROCESSES_ENV, "0")
    assert not processes.runs_elsewhere(config_from_preset("llama-tiny", device="meta"))


def test_the_pool_returns_the_same_capture_as_this_process(pool):
    for preset in ("llama-tiny", "mixtral-tiny", "resnet-tiny"):
        config = config_from_preset(preset, device="meta")
        phases = []
        elsewhere = processes.capture_anywhere(config, progress=phases.append)
        assert phases == ["capturing in a second process (shapes only)"]  # it did go to the pool
        same(elsewhere, capture_backward(config))


def test_two_meta_captures_run_at_the_same_time(pool):
    """Each worker reports its own process id: two captures submitted together are taken by two processes, neither
    of them this one."""
    config = config_from_preset("llama-tiny", device="meta")
    executor = processes._POOL.ready()
    pids = {f.result() for f in [executor.submit(_pid_after_capture, config) for _ in range(2)]}
    assert len(pids) == 2 and os.getpid() not in pids


def _pid_after_capture(config) -> int:
    capture_backward(config)
    time.sleep(0.5)  # long enough that the second submission cannot be taken by the same, still busy, worker
    return os.getpid()


def test_a_cancelled_wait_returns_at_once(pool):
    ticket = Ticket()
    ticket.cancel("cancelled by the user")
    started = time.perf_counter()
    with pytest.raises(CaptureCancelled, match="cancelled by the user"):
        processes.capture_anywhere(config_from_preset("llama-3.1-8b"), ticket=ticket)
    assert time.perf_counter() - started < 2.0  # 8B on meta takes ~0.6 s alone; the wait stops at its first poll


def test_a_killed_worker_is_replaced_and_the_capture_still_answers(pool):
    executor = processes._POOL.ready()
    for pid in list(executor._processes):
        os.kill(pid, signal.SIGKILL)
    config = config_from_preset("qwen2-tiny", device="meta")
    same(processes.capture_anywhere(config), capture_backward(config))  # here, after the broken pool is dropped
    assert processes.wait_for_pool(POOL_START_S)  # a new pool started behind it
    assert processes._POOL.ready() is not executor


FORKED = """
import threading
import networkx as nx
from graphviz_core.capture import workers as processes
from graphviz_core.capture.engine import capture_backward
from graphviz_core.config import config_from_preset
assert threading.active_count() == 1  # a CLI: no other Python thread, so B goes to a forked child
configs = [config_from_preset(p, device="meta", **kw) for p, kw in (("llama-tiny", {"attention": "eager"}),
           ("mistral-tiny", {"checkpoint": "none"}), ("mistral-tiny", {"checkpoint": "full"}))]
later = processes.capture_later(configs[0])
elsewhere = [later()]
assert threading.active_count() == 1  # the child's executor is gone: capture_many forks too
elsewhere += processes.capture_many(configs[1:])
assert processes._POOL._executor is None  # no fork server was started
for config, got in zip(configs, elsewhere, strict=True):
    here = capture_backward(config)
    assert (got.summary, got.memory, got.flops) == (here.summary, here.memory, here.flops), config
    assert nx.utils.graphs_equal(got.graph, here.graph) and got.timeline == here.timeline
print("same", len(configs))
"""


@pytest.mark.skipif(processes._has_accelerator(), reason="on a machine with a GPU the CLI runs meta captures itself "
                    "(test_a_process_on_a_machine_with_a_gpu_forks_no_child)")
def test_the_cli_forks_children_for_meta_captures_and_gets_the_same_captures():
    """The CLI's path, in a fresh process with no other Python thread (as `graphviz-core compare` and `memory` run):
    capture_later forks a child for B, capture_many forks one per meta config; each Capture is the one this process
    makes itself. Run apart from pytest's process, whose other threads make forking it unsafe."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", FORKED], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("same 3")


@pytest.mark.parametrize("gpu", [False, True])
def test_a_process_on_a_machine_with_a_gpu_forks_no_child(monkeypatch, gpu):
    """On a machine with a GPU a forked child cannot be trusted to capture: not once its parent has started CUDA (an
    H200's `memory --device cuda --checkpoints` died with "Cannot re-initialize CUDA in forked subprocess"), and not
    once its parent has run any backward, even on the CPU (autograd then keeps a thread per GPU, and the child's
    backward raised "Unable to handle autograd's threading in combination with fork-based multiprocessing":
    `memory --checkpoints` after other captures in one process on the H200). The CLI's fork is asked for with no
    thread but this one; it is taken only on a machine without a GPU, else the captures run here (no fork server is
    started for one command either)."""
    forked = []

    class Children:
        def __init__(self, max_workers, mp_context):
            forked.append(mp_context.get_start_method())

        def submit(self, *args):
            return None

        def shutdown(self, **kwargs):
            pass

    monkeypatch.setattr(processes.threading, "active_count", lambda: 1)
    monkeypatch.setattr(processes, "_has_accelerator", lambda: gpu)
    monkeypatch.setattr(processes, "ProcessPoolExecutor", Children)
    monkeypatch.setattr(processes._POOL, "ready", lambda: pytest.fail("the worker pool was started"))
    started, done = processes._started([config_from_preset("llama-tiny", device="meta")])
    done()
    assert forked == ([] if gpu else ["fork"])
    assert sorted(started) == ([] if gpu else [0])


def test_capture_later_of_a_cpu_config_runs_here_when_asked():
    config = config_from_preset("mlp", device="cpu")
    later = processes.capture_later(config)
    capture = later()
    assert capture.device == "cpu" and capture.time.forward_s is not None


def test_capture_many_keeps_the_order_and_the_results(pool):
    """The checkpointing table's three meta captures side by side in the pool, a CPU one among them run here."""
    configs = [config_from_preset("llama-tiny", device="meta", checkpoint=policy) for policy in ("none", "full", "selective")]
    configs.insert(1, config_from_preset("mlp", device="cpu"))
    lines = []
    captures = processes.capture_many(configs, progress=lines.append)
    assert [c.config for c in captures] == configs
    for config, capture in zip(configs, captures, strict=True):
        if config.device == "meta":
            same(capture, capture_backward(config))
        else:
            assert capture.device == "cpu" and capture.time.forward_s is not None  # timed here
    assert len(lines) == 4 and lines[0].startswith("capturing ")


SCRIPT = """import os, pathlib
pathlib.Path({folder!r}).joinpath(str(os.getpid())).touch()
"""


def test_workers_do_not_run_the_main_script_again(monkeypatch, tmp_path):
    """In a server, `__main__` is the app script Streamlit ran last; multiprocessing runs the parent's main module in
    each child before its task, so each worker ran app.py once more (and filled the server's log with Streamlit's
    bare-mode warnings). A stand-in script that leaves a file per process that ran it: none may appear."""
    import sys
    import types

    ran = tmp_path / "ran"
    ran.mkdir()
    script = tmp_path / "app_stand_in.py"
    script.write_text(SCRIPT.format(folder=str(ran)))
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setenv(processes.PROCESSES_ENV, "2")
    pool = processes._Pool()
    try:
        assert pool.wait_ready(POOL_START_S), "the worker processes did not answer"
        executor = pool.ready()
        pids = {executor.submit(os.getpid).result(timeout=60) for _ in range(4)}
        assert pids and os.getpid() not in pids
    finally:
        pool.shut_down()
    assert sys.modules["__main__"] is main  # what a script run installed is left in place
    assert not list(ran.iterdir()), sorted(path.name for path in ran.iterdir())


def test_the_pool_starts_every_worker_even_when_the_first_answers_at_once(monkeypatch):
    """ProcessPoolExecutor starts another worker for a call only when no worker is idle. The pool's first calls (one
    per worker) once returned at once: under load the first worker had answered before the second call was submitted,
    sat idle, and the pool ran one worker instead of two (a fresh-clone run found the fork server and one worker, 120 s
    after the first dry run). Here the second call is submitted 3 s after the first, which always gave one worker
    before: each first call is now held until every worker has answered."""
    from concurrent.futures import ProcessPoolExecutor

    class SlowSecondCall(ProcessPoolExecutor):
        calls = 0

        def submit(self, *args, **kwargs):
            SlowSecondCall.calls += 1
            if SlowSecondCall.calls == 2:
                time.sleep(3)  # the first worker has started and answered (the fork server imported first)
            return super().submit(*args, **kwargs)

    monkeypatch.setattr(processes, "ProcessPoolExecutor", SlowSecondCall)
    monkeypatch.setenv(processes.PROCESSES_ENV, "2")
    pool = processes._Pool()
    try:
        pool.ready()  # starts it in the background
        assert pool.wait_ready(POOL_START_S), "the worker processes did not answer"
        executor = pool.ready()
        assert SlowSecondCall.calls == 2 and len(executor._processes) == 2, executor._processes
    finally:
        pool.shut_down()
