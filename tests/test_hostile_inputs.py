"""Hostile input on the newest flags (issue 37): each bad input ends in seconds with one sentence (exit 2 and one line
on stderr from the command line, a notice on a page) or with a result, never a traceback, a hang, a machine full of
processes or output that is not JSON. One section per item of the issue."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphviz_core import cli
from graphviz_core.cli import main
from graphviz_core.config import resolve_config
from graphviz_core.parallel import planner
from graphviz_core.parallel.planner import Cluster, Layout, Plan, Planned, layouts_of, rate_problem
from graphviz_core.parallel.settings import ParallelConfig, check_parallel
from graphviz_core.units import format_seconds
from tests import docs_zygote

ROOT = Path(__file__).resolve().parent.parent
HUGE = str(2**63)
# The issue's two-GPU plan: llama-tiny on one node of 2, global batch 4, no checkpointing, microbatch 1. Its meshes
# are FSDP 2 and TP 2 + SP (pp 1, cp 1): two layouts, 6 s in one process.
PLAN = ["plan", "--preset", "llama-tiny", "--gpus", "2", "--gpus-per-node", "2", "--global-batch", "4",
        "--checkpoints", "none", "--microbatch-sizes", "1", "--pp-degrees", "1", "--cp-degrees", "1"]


def refused(args: list[str], capsys) -> str:
    """The one line `args` got on stderr; fails unless the command exited 2 with one line, no traceback, no output."""
    started = time.perf_counter()
    assert main(args) == 2
    assert time.perf_counter() - started < 30  # seconds, not a loop
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err and captured.out == "", captured.err
    return lines[0]


def command(args: list[str], timeout: float = 240, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m graphviz_core ARGS` as a user runs it: its own process (one thread, so `plan` forks workers)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return docs_zygote.run_cli(args, cwd=cwd, timeout=timeout, env=env)


# ---- 1. plan --jobs: bounded by the cores and the runs, the absurd refused ---------------------------------------


def test_a_plan_starts_no_more_workers_than_cores_or_runs(monkeypatch):
    monkeypatch.setattr(planner.os, "cpu_count", lambda: 4)
    assert planner.worker_count(1000, 2) == 2  # two sample runs: two workers, not 1,000 (the issue's two-layout plan)
    assert planner.worker_count(1000, 50) == 4  # the cores
    assert planner.worker_count(3, 50) == 3  # what was asked
    monkeypatch.setattr(planner.os, "cpu_count", lambda: None)  # unknown: one
    assert planner.worker_count(8, 50) == 1


@pytest.mark.parametrize("jobs", ["0", "-1", "1000", HUGE])
def test_absurd_jobs_are_refused_with_a_sentence(jobs, capsys):
    assert "--jobs takes 1 to 256 worker processes" in refused([*PLAN, "--jobs", jobs], capsys)


def test_many_jobs_on_a_small_plan_end_with_the_plan():
    done = command([*PLAN, "--jobs", "200"])  # asked for 200; started min(200, cores, 2 runs)
    assert done.returncode == 0, done.stderr[-2000:]
    labels = [layout["label"] for layout in json.loads(done.stdout)["layouts"]]
    assert sorted(labels) == ["FSDP 2, none, microbatch 1", "TP 2 + SP, none, microbatch 1"]


def test_a_fork_the_system_refuses_is_a_sentence(monkeypatch):
    """Under a process limit the fork raised BlockingIOError out of the pool: a traceback, then a hang."""

    class Refused:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, *args, **kwargs):
            raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(planner, "ProcessPoolExecutor", Refused)
    monkeypatch.setattr(planner.threading, "active_count", lambda: 1)  # as in the command line: the fork path
    monkeypatch.setattr(planner.os, "cpu_count", lambda: 2)
    with pytest.raises(ValueError, match=r"the plan's 2 worker processes could not run \(BlockingIOError: \[Errno 11\] "
                                         r"Resource temporarily unavailable\); try --jobs 1"):
        planner.plan(resolve_config("llama-tiny"), Cluster(gpus=2, gpus_per_node=2), 4, ("none",), (1,), (1,), jobs=8)


# ---- 2. repeated degrees collapse -------------------------------------------------------------------------------


def test_repeated_degrees_and_sizes_plan_each_layout_once():
    config, cluster = resolve_config("llama-tiny"), Cluster(gpus=2, gpus_per_node=2)
    once, _ = layouts_of(config, cluster, 4, ("none",), (1,), (1,), (1,))
    assert len(once) == 2  # FSDP 2 and TP 2 + SP
    for repeated in [dict(pp_degrees=(1, 1)), dict(cp_degrees=(1, 1)), dict(microbatch_sizes=(1, 1)),
                     dict(checkpoints=("none", "none")), dict(pp_degrees=(1,) * 10_000)]:
        args = {"checkpoints": ("none",), "microbatch_sizes": (1,), "pp_degrees": (1,), "cp_degrees": (1,), **repeated}
        layouts, _ = layouts_of(config, cluster, 4, **args)
        assert layouts == once, repeated


def test_the_issues_repeated_degrees_end():
    """`--pp-degrees 1,1 --cp-degrees 1,1 --microbatch-sizes 1,1 --jobs 1` stopped at [2/4] for good."""
    args = [*PLAN, "--jobs", "1", "--pp-degrees", "1,1", "--cp-degrees", "1,1", "--microbatch-sizes", "1,1"]
    done = command(args, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(json.loads(done.stdout)["layouts"]) == 2
    assert done.stderr.count("[") == 2 and "[2/2]" in done.stderr  # two layouts, said once each


def test_ten_thousand_ones_are_one_degree():
    assert cli._numbers("--pp-degrees", ",".join(["1"] * 10_000)) == (1,)
    assert cli._numbers("--pp-degrees", "2,1,2") == (2, 1)


# ---- 3. every size the planner reads is bounded, divisors in sqrt(n) --------------------------------------------


@pytest.mark.parametrize("flag, sentence", [
    ("--gpus-per-node", "gpus per node 9,223,372,036,854,775,808 is above the planner's limit of 4,096."),
    ("--gpus", "gpus 9,223,372,036,854,775,808 is above the planner's limit of 4,096."),
    ("--global-batch", "global batch must be a whole number from 1 to 1,048,576"),
])
def test_huge_sizes_get_a_sentence_in_seconds(flag, sentence, capsys):
    args = [*PLAN, flag, HUGE]
    assert sentence in refused(args, capsys)


@pytest.mark.parametrize("memory", ["99999999999999999999TiB", "2PiB", "0.0000001B"])
def test_memory_outside_the_planners_range_is_a_sentence(memory, capsys):
    assert "memory size" in refused([*PLAN, "--gpu-memory", memory], capsys)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=1, max_value=5000))
def test_divisors_are_every_divisor_in_order(n):
    assert planner._divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_divisors_of_a_large_number_take_its_square_root():
    started = time.perf_counter()
    assert planner._divisors(10**8)[:4] == [1, 2, 4, 5] and planner._divisors(10**8)[-1] == 10**8
    assert time.perf_counter() - started < 1  # range(1, n + 1) took 9 s


@pytest.mark.parametrize("values, problem", [
    (range(1, 100), "at most 64 different values"),
    ([0], "whole numbers from 1 to"),
    ([5000], "whole numbers from 1 to 4,096"),
    ([], "give at least one value"),
])
def test_lists_to_try_are_bounded(values, problem):
    with pytest.raises(ValueError, match=problem):
        planner.distinct(values, "pipeline degrees", 4096)


# ---- 4. rates are finite and in range; the JSON is always JSON --------------------------------------------------


@pytest.mark.parametrize("flag", ["--gpu-tflops", "--nvlink-gbps", "--infiniband-gbps"])
@pytest.mark.parametrize("value", ["1e-320", "inf", "1e309", "nan", "0", "-1", "1e400"])
def test_rates_that_are_not_finite_or_not_plausible_are_refused(flag, value, capsys):
    line = refused([*PLAN, flag, value], capsys)
    assert flag in line and ("takes a rate from" in line or "takes a finite number" in line), line


def test_the_plan_tabs_rate_fields_refuse_what_the_cli_refuses():
    from graphviz_core.ui.plan_view import out_of_range

    inputs = {"gpus": 8, "batch": 16, "per_node": 8, "tflops": 1e-320, "nvlink": 450.0, "infiniband": math.inf}
    problems = out_of_range(inputs)
    assert len(problems) == 2  # 1e-320 showed as 0.00 and passed "above 0"; infinity passed too
    assert problems[0].startswith("GPU TFLOP/s (dense) takes a rate from 1e-06 to 1e+09 TFLOP/s")
    assert problems[1].startswith("Network GB/s per GPU takes a rate from 1e-06 to 1e+06 GB/s")
    assert out_of_range({**inputs, "tflops": 989.4, "infiniband": 50.0}) == []


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_any_number_of_seconds_is_shown_without_an_error(seconds):
    text = format_seconds(seconds)  # inf was an OverflowError in round(), and the page's "encountered an error"
    assert isinstance(text, str) and len(text) < 30


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_rate_is_taken_only_when_finite_and_in_range(value):
    problem = rate_problem("gpu_flops", value, "--gpu-tflops", 1e12)
    assert (problem is None) == (math.isfinite(value) and 1e-6 <= value <= 1e9)


def _plan_with_step(step_time_s: float) -> Plan:
    config, cluster = resolve_config("llama-tiny"), Cluster(gpus=2, gpus_per_node=2)
    layout = Layout(2, 1, 1, 1, "none", 1, 1, 2)
    planned = Planned(layout, 1000, True, 10, 10, 20, 100, step_time_s, 0.0, None, step_time_s, 0.0)
    return Plan(config, cluster, 4, (planned,), (), 1.0)


def test_a_plan_whose_times_overflow_is_still_json_and_says_so():
    data = _plan_with_step(math.inf).to_dict()
    text = json.dumps(data, allow_nan=False)  # "Infinity" is not JSON: this raised before
    estimate = json.loads(text)["layouts"][0]["estimate"]
    assert estimate["step_time_s"] is None and estimate["compute_s"] is None
    assert "layouts[0].estimate.compute_s" in data["notes"][0] and "written as null" in data["notes"][0]
    assert "notes" not in _plan_with_step(2.5).to_dict()  # finite figures: no note


def test_every_json_the_cli_writes_turns_non_finite_numbers_into_null_with_a_note():
    text = cli._json({"a": [1.0, math.nan], "b": {"c": -math.inf}, "notes": ["already here"]})
    data = json.loads(text)
    assert data["a"] == [1.0, None] and data["b"] == {"c": None}
    assert data["notes"][0] == "already here" and data["notes"][1].startswith("a[1], b.c: not a finite number")


# ---- 5. memory --budget-gib ------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["inf", "1e309", "nan", "0", "-1", "1e300", "1e-300"])
def test_a_budget_that_is_not_a_finite_size_is_refused(budget, capsys):
    line = refused(["memory", "--preset", "gpt2-tiny", "--budget-gib", budget], capsys)
    assert "--budget-gib" in line and ("takes a memory budget from" in line or "takes a finite number" in line), line


@pytest.mark.parametrize("budget", [math.inf, math.nan, 80.5 * 2**30, 0, True])
def test_the_fit_search_takes_a_whole_number_of_bytes(budget):
    from graphviz_core.analysis.fit import largest_fitting

    with pytest.raises(ValueError, match="the memory budget is a whole number of bytes above 0"):
        largest_fitting(resolve_config("gpt2-tiny"), budget, "none", "batch")


# ---- 6. the message shortener keeps each quoted value whole -----------------------------------------------------


def say(text: str, capsys) -> str:
    cli._say(text)
    return capsys.readouterr().err.strip()


def test_short_quoted_values_around_a_long_list_stay_whole(capsys):
    names = ", ".join(f"layer.{i}.weight" for i in range(40))  # 600 characters between the two quoted values
    line = say(f"--freeze 'nomatch*' matches no parameter; names include: {names} (a glob: '*embed*' finds embed)",
               capsys)
    assert line == f"--freeze 'nomatch*' matches no parameter; names include: {names} (a glob: '*embed*' finds embed)"


def test_a_long_quoted_value_is_cut_and_its_length_said(capsys):
    line = say(f"--freeze {'x' * 500!r} matches no parameter; '*embed*' finds embed", capsys)
    assert line == f"--freeze '{'x' * 60}… (500 characters)' matches no parameter; '*embed*' finds embed"
    assert say("model's layer 'a' and torch's 'b'", capsys) == "model's layer 'a' and torch's 'b'"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="abc*?[]._-", min_size=1, max_size=20), min_size=1, max_size=6),
       st.integers(min_value=0, max_value=400), st.sampled_from([" ", ", ", "; ", " (", ") "]))
def test_every_short_quoted_value_survives_the_shortener(values, gap, mark):
    """Quoted values with text between them as sentences have it: a space or a mark on each side."""
    import io
    from contextlib import redirect_stderr

    text = (mark + "x" * gap + mark).join(repr(v) for v in values)
    buffer = io.StringIO()
    with redirect_stderr(buffer):
        cli._say(text)
    assert buffer.getvalue().rstrip("\n") == text  # nothing quoted is 100 characters long: nothing is cut


@pytest.mark.parametrize("args", [
    ["graph", "--preset", "gpt2-tiny", "--freeze", "nomatch*"],
    ["graph", "--preset", "gpt2-tiny", "--freeze", "["],
    ["compare", "--preset", "gpt2-tiny", "--vs", "--freeze", "?"],
])
def test_the_freeze_sentence_keeps_the_names_it_promises(args, capsys):
    line = refused(args, capsys)
    assert "parameter names include: wte.weight, wpe.weight" in line and "'*embed*' finds embed" in line, line


def test_the_resnet_lora_sentence_keeps_its_example(capsys):
    line = refused(["graph", "--preset", "resnet-tiny", "--finetune", "lora"], capsys)
    assert "e.g. 'convolution'); name the layers to adapt" in line


# ---- 7. 0 and '' are values given, not "not given" -------------------------------------------------------------


@pytest.mark.parametrize("args, sentence", [
    (["--pp", "0"], "pp must be a whole number >= 1, got 0."),
    (["--strategy", "fsdp", "--world-size", "2", "--cp", "0"], "cp must be a whole number >= 1, got 0."),
    (["--pp", "2", "--microbatches", "0"], "microbatches must be a whole number >= 1, got 0."),
    (["--strategy", "tp", "--tp", "0"], "tp must be a whole number >= 1, got 0."),
    (["--intermediate", "0"], "--intermediate 0 would be read as not set (4 x hidden); give a value >= 1"),
    (["--kv-heads", "0"], "--kv-heads 0 would be read as not set (as many as --heads)"),
    (["--finetune", "lora", "--lora-targets", ""], "--lora-targets '' names nothing"),
    (["--freeze", " "], "--freeze '' names nothing"),
])
def test_zero_and_empty_are_refused_not_read_as_not_given(args, sentence, capsys):
    assert sentence in refused(["graph", "--preset", "llama-tiny", *args], capsys)


def test_an_empty_model_file_is_refused(capsys):
    assert "--model-file takes PATH:FACTORY" in refused(["graph", "--model-file", ""], capsys)


def test_a_gpu_memory_without_its_unit_is_refused(capsys):
    line = refused([*PLAN, "--gpu-memory", "80"], capsys)
    assert line == "graphviz-core: a memory size needs its unit: 80GiB, 80GB or 80B (bytes), not '80' alone."
    assert planner.parse_bytes("4096B") == 4096 and planner.parse_bytes("80GiB") == 80 * 2**30


def test_plan_refuses_compile_rather_than_planning_eager(capsys):
    assert "turn compile off to plan" in refused([*PLAN, "--compile"], capsys)


# ---- 8. sentences that say what is wrong -------------------------------------------------------------------------


@pytest.mark.parametrize("args, sentence", [
    (["graph", "--preset", "llama-tiny", "--pp", "2", "--stages-per-rank", "-1"],
     "stages per rank must be a whole number >= 1, got -1."),
    (["graph", "--preset", "llama-tiny", "--strategy", "tp", "--world-size", "2", "--tp", "2", "--pp", "2"],
     "strategy 'tp' needs at least 2 ranks in each pipeline stage; world size 2 over 2 stages leaves one rank per "
     "stage"),
    ([*PLAN[:-4], "--gpus", "8", "--gpus-per-node", "8", "--global-batch", "16", "--pp-degrees", "3"],
     "pipeline parallel 3 does not divide the 8 GPUs into stages of equal ranks"),
    ([*PLAN, "--gpu-memory", "-80GiB"], "a memory size is a positive number and a unit (80GiB, 80GB, 81920MiB), not "
                                        "'-80GiB'."),
    (["expr", "α*2", "α=1"], "'α' in 'α=1' is not a variable name: a name starts with a letter A-Z or a-z"),
    (["expr", "α*2"], "the name 'α' at column 1 is not allowed; a name starts with a letter A-Z or a-z"),
])
def test_each_sentence_names_the_cause(args, sentence, capsys):
    assert sentence in refused(args, capsys)


def test_a_mixed_precision_refusal_on_the_parallel_page_does_not_name_a_strategy():
    from graphviz_core.ui.parallel_view import in_user_words

    config = resolve_config("llama-tiny", dtype="bfloat16")
    with pytest.raises(ValueError) as refusal:
        check_parallel(config, ParallelConfig("fsdp", 8, mixed_precision="bf16"))
    shown = in_user_words(str(refusal.value))
    assert "one device" not in shown and shown.endswith("set dtype float32 (got bfloat16) or mixed precision none.")
    with pytest.raises(ValueError) as refusal:
        ParallelConfig("tp", 2, tp=2, mixed_precision="bf16")
    assert "one device" not in in_user_words(str(refusal.value))


# ---- 9. links: values capped, repeats refused, digits 0-9 only --------------------------------------------------


class Query(dict):
    """st.query_params as read_params reads it: each name with every value it was given."""

    def get_all(self, name):
        return list(self[name])


def test_a_huge_link_value_is_refused_in_a_short_sentence_at_once():
    from graphviz_core.ui.links import parse_config

    started = time.perf_counter()
    config, problems = parse_config({"preset": "x" * 100_000})
    assert config is None and problems == ["preset= is 100,000 characters long, above the 300 a link's value may have"]
    config, problems = parse_config({"hidden": "9" * 100_000})
    assert config is None and len(problems[0]) < 120
    assert time.perf_counter() - started < 1


def test_a_repeated_or_huge_parameter_is_named_not_taken():
    from graphviz_core.ui.links import read_params

    values, problems = read_params(Query({"hidden": ["48", "64"], "preset": ["x" * 1000], "layers": ["3"]}))
    assert values == {"layers": "3"}
    assert problems == {"hidden": "hidden= is given 2 times; a link names each setting once",
                        "preset": "preset= is 1,000 characters long, above the 300 a link's value may have"}


@pytest.mark.parametrize("raw", ["٤٨", "４８", "48.0", "1e3", " ", "0x30"])
def test_link_numbers_are_the_digits_0_to_9(raw):
    from graphviz_core.ui.links import coerce

    value, problem = coerce("hidden", raw, int)
    assert value is None and "is not a whole number written with the digits 0-9" in problem


@pytest.mark.parametrize("args", [["--pp", "٢"], ["--hidden", "٤٨"], ["--seed", "１"]])
def test_command_line_numbers_are_the_digits_0_to_9(args, capsys):
    assert "takes a whole number written with the digits 0-9" in refused(["graph", "--preset", "llama-tiny", *args],
                                                                         capsys)


def test_a_page_opened_by_a_repeated_or_huge_link_says_so_and_keeps_one_value():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.query_params.update({"hidden": ["48", "96"], "search": "x" * 100_000})
    at.run()
    assert not at.exception
    notices = [w.value.replace("\\", "") for w in at.warning]  # escaped for Markdown
    assert any("hidden= is given 2 times" in n for n in notices), notices
    assert any("search= is 100,000 characters long" in n for n in notices), notices
    assert all(len(n) < 400 for n in notices)
    assert at.number_input(key="config.hidden").value == 64  # the default preset's (gpt2-tiny), neither 48 nor 96
    assert "hidden" not in at.query_params and "search" not in at.query_params  # neither stays in the address bar


# ---- 10. a model file keeps out of the JSON channel ---------------------------------------------------------------

BASE = """
import torch
from torch import nn


def made():
    return nn.Linear(3, 2), (torch.randn(4, 3),), lambda out: out.sum()
"""
MODEL_FILES = {
    "prints": 'import os\nprint("at import")\n\ndef make():\n    print("in make")\n    os.write(1, b"to fd 1\\n")\n'
              "    return made()\n",
    "no_stdout": "import sys\n\ndef make():\n    sys.stdout = None\n    return made()\n",
    "thread": "import threading, time\n\ndef make():\n    threading.Thread(target=time.sleep, args=(600,), "
              "name='sleeper').start()\n    return made()\n",
    "exits": "import os\n\ndef make():\n    os._exit(0)\n",
}


@pytest.mark.parametrize("name, code, note", [
    ("prints", 0, "printed 18 characters; they went to stderr, so stdout holds only graphviz-core's output."),
    ("no_stdout", 0, "replaced sys.stdout; graphviz-core put its own back."),
    ("thread", 0, "started 1 thread(s) still running (sleeper); graphviz-core writes its output and exits without "
                  "waiting for them."),
    ("exits", 2, "called os._exit(0) while loading it (importing the file and calling make()); a model file must "
                 "return its model, not stop the program."),
])
def test_a_model_file_cannot_corrupt_or_hold_the_output(name, code, note, tmp_path):
    path = tmp_path / f"{name}.py"
    path.write_text(BASE + MODEL_FILES[name])
    started = time.perf_counter()
    done = command(["graph", "--model-file", f"{path}:make"], timeout=120, cwd=tmp_path)
    assert time.perf_counter() - started < 100  # the sleeper's 600 s are not waited for
    assert done.returncode == code, done.stderr[-2000:]
    assert note in done.stderr and "Traceback" not in done.stderr
    if code == 0:
        assert json.loads(done.stdout)["summary"]["nodes"] > 0  # stdout is the JSON and only the JSON
    if name == "prints":  # print()s: "at import\n" and "in make\n", 10 + 8 = 18 characters; os.write(1) is on stderr too
        assert "at import" in done.stderr and "in make" in done.stderr and "to fd 1" in done.stderr
