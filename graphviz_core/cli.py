"""The `graphviz-core` command line (docs/cli.md): `graph` captures one step and exports its autograd graph (and, with
a parallel layout, simulates its ranks), `memory` writes the memory panel, `compare` diffs two configs, `plan` ranks
the parallel layouts of a GPU count, `expr` traces a toy expression; `record`, `recording` and `debug` (cli_record.py,
cli_debug.py) record a user's own training script, print a recording, and find its gradient-flow problems.

Every subcommand exits 0 on success and 2 with one line on stderr for bad input, never a traceback; Ctrl-C ends it
with one line and 130.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

from graphviz_core.cli_record import whole_number
from graphviz_core.config import (
    PRESETS,
    choices_of,
    field_help,
    preset_named,
    resolve_config,
)
from graphviz_core.fields import CHOICE, FIELDS, NAMES, SIZE, SWITCH, named

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a program stopped by Ctrl-C
# Every config field is a flag of the kind its declaration says (graphviz_core.fields).
INT_FLAGS = named(SIZE)
TEXT_FLAGS = named(NAMES)
CHOICE_FLAGS = {name: choices_of(name) for name in named(CHOICE)}
SWITCH_FLAGS = named(SWITCH)
CONFIG_FLAGS = (*CHOICE_FLAGS, *INT_FLAGS, *TEXT_FLAGS, *SWITCH_FLAGS)  # every config field a flag sets


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; the contract is one line on stderr and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _BadInput(f"{self.prog}: {message} (see --help)")


class _BadInput(Exception):
    pass


def _decimal(text: str) -> float:
    """A finite number written with the digits 0-9 (e.g. 989.4 or 1e3); not inf or nan, nor other scripts' digits."""
    if not re.fullmatch(r"\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,4})?\s*", text):
        raise argparse.ArgumentTypeError(f"takes a finite number written with the digits 0-9 (e.g. 989.4), got {text!r}")
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"takes a finite number, got {text!r} (beyond what a float holds)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="graphviz-core", description="See what loss.backward() does to a model.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    graph = commands.add_parser("graph", help="capture a real backward pass and export its autograd graph")
    _add_config_flags(graph)
    graph.add_argument("--model-file", metavar="PATH:FACTORY",
                       help="capture your own nn.Module: FACTORY() in PATH returns (module, example inputs, loss function)")
    _add_parallel_flags(graph)
    graph.add_argument("--format", choices=("json", "html", "graphml", "dot", "svg", "png"), default="json",
                       help="png: the html page photographed by headless Chromium (/usr/bin/chromium)")
    graph.add_argument("--png-size", default=None, metavar="WIDTHxHEIGHT",
                       help="png: the page's size in CSS pixels, each side 100..8000 (default: 1600 wide and as tall as "
                            "the layers need, at least 1000: up to 48 layers one column, top to bottom, as the app's "
                            "PNG downloads; deeper graphs folded into as few columns as fit 1600 wide, as tall as they need)")
    graph.add_argument("--png-scale", type=whole_number, default=2, choices=(1, 2, 3, 4),
                       help="png: device pixels per CSS pixel (default 2: a 1600x1000 page gives 3200x2000 pixels)")
    graph.add_argument("-o", "--output", help="file to write (default: stdout)")

    expr = commands.add_parser("expr", help="trace backprop through a scalar expression, step by step")
    expr.add_argument("expression", help='e.g. "(a*b + c)**2"')
    expr.add_argument("values", nargs="*", help="NAME=VALUE for every variable, e.g. a=2 b=-3 c=10")
    expr.add_argument("--format", choices=("json",), default="json")
    expr.add_argument("-o", "--output", help="file to write (default: stdout)")
    compare = commands.add_parser(
        "compare", help="capture two configs and print their diff as JSON",
        description="Config A's flags, then --vs and config B's flags. B starts from A's flags (or from its own "
                    "--preset, when given) and overrides them: `compare --preset gpt2-tiny --vs --attention manual`.",
    )
    _add_config_flags(compare)
    compare.add_argument("--vs", nargs=argparse.REMAINDER, required=True, metavar="B_FLAGS",
                         help="config B's flags (same flags as A's)")
    compare.add_argument("-o", "--output", help="file to write (default: stdout)")
    _add_memory_command(commands)
    _add_plan_command(commands)
    # Run before parsing (graphviz_core.cli_record, which has their flags); listed so that --help names them.
    commands.add_parser("record", help="run your training script unchanged and record its steps (docs/recording.md)")
    commands.add_parser("recording", help="print a recording's steps and parameters as JSON")
    commands.add_parser("debug", help="gradient-flow findings of a recording or of one step of a preset: where a NaN "
                        "started, parameters with no gradient (docs/debugging.md)")
    return parser


def _add_plan_command(commands) -> None:
    from graphviz_core.parallel.settings import H100_FLOPS, INFINIBAND_BYTES_PER_S, NVLINK_BYTES_PER_S

    plan = commands.add_parser(
        "plan", help="the layouts of a model on N GPUs, each simulated, ranked: which fit, which is fastest",
        description="Enumerates data-shard x data-replicate x tensor x pipeline x context parallel meshes (tensor "
                    "parallel inside a node, with sequence parallel where the model takes it), checkpointing policies "
                    "and microbatch sizes; simulates each (scaled from 3 and 4 layers per stage) and ranks them: "
                    "fitting first, then by estimated tokens/s per GPU. Progress on stderr.",
    )
    _add_config_flags(plan)
    plan.add_argument("--gpus", type=whole_number, required=True, help="GPUs in all")
    plan.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 80GiB (H100 80GB, the default), 141GB")
    plan.add_argument("--global-batch", type=whole_number, required=True, help="sequences per optimizer step, all GPUs together")
    plan.add_argument("--gpus-per-node", type=whole_number, default=8, help="GPUs per node, joined by NVLink (default 8)")
    plan.add_argument("--gpu-tflops", type=_decimal, default=H100_FLOPS / 1e12,
                      help=f"dense TFLOP/s per GPU in the model's dtype (default {H100_FLOPS / 1e12:g}: H100 SXM, BF16)")
    plan.add_argument("--nvlink-gbps", type=_decimal, default=NVLINK_BYTES_PER_S / 1e9,
                      help="GB/s per GPU each way inside a node (default 450: NVLink 4 on H100 SXM)")
    plan.add_argument("--infiniband-gbps", type=_decimal, default=INFINIBAND_BYTES_PER_S / 1e9,
                      help="GB/s per GPU each way between nodes (default 50: one 400 Gb/s NDR NIC per GPU)")
    plan.add_argument("--checkpoints", default="none,selective,full",
                      help=f"checkpointing policies to try, comma-separated, of {', '.join(CHOICE_FLAGS['checkpoint'])} "
                           "(default none,selective,full)")
    plan.add_argument("--microbatch-sizes", default="1,2", help="sequences per microbatch to try (default 1,2)")
    plan.add_argument("--pp-degrees", default="1,2", help="pipeline-parallel degrees to try (default 1,2)")
    plan.add_argument("--cp-degrees", default="1,2",
                      help="context-parallel degrees to try (default 1,2; beside a pipeline only with --cp-with-pp)")
    plan.add_argument("--cp-with-pp", action="store_true",
                      help="also try context parallel together with pipeline stages (pp x cp layouts: each a pipeline "
                      "simulation, several seconds of CPU per sample for 70B, so off by default)")
    plan.add_argument("--tp-degrees", help="tensor-parallel degrees to try (default: every power of 2 up to "
                      "--gpus-per-node; never more than a node). Tensor parallel runs with sequence parallel wherever "
                      "the model takes it (a Llama-style decoder, a sequence that splits over TP), as torchtitan does; "
                      "plain TP otherwise")
    plan.add_argument("--mixed-precision", choices=("none", "bf16", "bf16-fp32-reduce"), default="none",
                      help="FSDP2's policy for every layout (bf16: float32 master shards, bfloat16 compute; needs "
                      "--dtype float32)")
    plan.add_argument("--jobs", type=whole_number, default=2, help="worker processes simulating at once (default 2)")
    plan.add_argument("--format", choices=("json", "table"), default="json")
    plan.add_argument("-o", "--output", help="file to write (default: stdout)")


def _numbers(flag: str, text: str) -> tuple[int, ...]:
    """'1,2,2' -> (1, 2): whole numbers >= 1 in the digits 0-9, a repeat collapsed (each layout is planned once)."""
    items = [v.strip() for v in text.split(",")]
    if not all(re.fullmatch(r"[0-9]{1,9}", v) for v in items) or min(int(v) for v in items) < 1:
        raise ValueError(f"{flag} takes whole numbers >= 1 separated by commas (e.g. 1,2), not {text!r}.")
    return tuple(dict.fromkeys(int(v) for v in items))


def _plan_command(args: argparse.Namespace) -> str:
    from graphviz_core.parallel.planner import MAX_JOBS, Cluster, parse_bytes, plan, rate_problem

    for flag in ("batch", "checkpoint"):
        if getattr(args, flag) is not None:
            raise ValueError(f"the plan chooses the --{flag} itself; drop it (see --global-batch, --microbatch-sizes "
                             "and --checkpoints).")
    for flag, field, scale in (("gpu_tflops", "gpu_flops", 1e12), ("nvlink_gbps", "nvlink_bytes_per_s", 1e9),
                               ("infiniband_gbps", "infiniband_bytes_per_s", 1e9)):
        if problem := rate_problem(field, getattr(args, flag), f"--{flag.replace('_', '-')}", scale):
            raise ValueError(problem)
    if not 1 <= args.jobs <= MAX_JOBS:
        raise ValueError(f"--jobs takes 1 to {MAX_JOBS} worker processes, got {args.jobs}; the plan starts no more "
                         "than this machine's cores and the simulations it has to run.")
    config = _config_of(args)
    cluster = Cluster(gpus=args.gpus, gpu_memory_bytes=parse_bytes(args.gpu_memory), gpus_per_node=args.gpus_per_node,
                      gpu_flops=args.gpu_tflops * 1e12, nvlink_bytes_per_s=args.nvlink_gbps * 1e9,
                      infiniband_bytes_per_s=args.infiniband_gbps * 1e9)
    policies = config.family.checkpoint_policies()
    checkpoints = []
    for name in args.checkpoints.split(","):
        resolved = config.replace(checkpoint=name.strip()).checkpoint  # `selective` is the family's own
        if resolved not in checkpoints:
            checkpoints.append(resolved)
    if not set(checkpoints) <= set(policies):
        raise ValueError(f"--checkpoints takes policies of {', '.join(policies)}, not {args.checkpoints!r}.")

    def progress(done: int, total: int, what: str) -> None:
        sys.stderr.write(f"[{done}/{total}] {what}\n")
        sys.stderr.flush()

    result = plan(config, cluster, args.global_batch, checkpoints, _numbers("--microbatch-sizes", args.microbatch_sizes),
                  _numbers("--pp-degrees", args.pp_degrees), jobs=args.jobs, progress=progress,
                  cp_degrees=_numbers("--cp-degrees", args.cp_degrees),
                  tp_degrees=_numbers("--tp-degrees", args.tp_degrees) if args.tp_degrees else None,
                  mixed_precision=args.mixed_precision, cp_with_pp=args.cp_with_pp)
    if args.format == "table":
        return _plan_table(result)
    return _json({**result.to_dict(), "config": _config_echo(config)})


def _plan_table(result) -> str:
    from graphviz_core.units import format_bytes, format_seconds

    lines = [f"{'layout':<50}{'peak':>11}  {'fits':<5}{'sent/step':>11}{'step (est.)':>13}{'tok/s/GPU (est.)':>18}"]
    for p in result.planned:
        lines.append(f"{p.layout.label():<50}{format_bytes(p.peak_bytes):>11}  {'yes' if p.fits else 'no':<5}"
                     f"{format_bytes(p.collective_bytes_per_step):>11}{format_seconds(p.step_time_s):>13}"
                     f"{p.tokens_per_s_per_gpu:>18,.0f}")
    lines.append(f"{len(result.planned)} layouts simulated in {result.simulate_s:.1f} s; {len(result.skipped)} skipped "
                 "(see --format json). Times and tokens/s are estimates: measured FLOPs and bytes at the stated rates.")
    return "\n".join(lines)


def _add_memory_command(commands) -> None:
    from graphviz_core.analysis.training_step import ACCELERATORS

    memory = commands.add_parser(
        "memory", help="the memory panel as JSON: peak, timeline, training step; checkpointing and will-it-fit",
        description="Captures the config and writes {peak_bytes, timeline, training_step, accelerators} as JSON; "
                    "--checkpoints adds none/full/selective side by side (captured on meta), --budget-gib or "
                    "--accelerator adds the largest batch and seq that fit per checkpoint policy.",
    )
    _add_config_flags(memory)
    memory.add_argument("--checkpoints", action="store_true",
                        help="also compare none / full / selective checkpointing (meta captures)")
    budget = memory.add_mutually_exclusive_group()
    budget.add_argument("--budget-gib", type=_decimal, help="memory budget for will-it-fit, in GiB")
    budget.add_argument("--accelerator", choices=[name.split(" (")[0] for name in ACCELERATORS],
                        help="memory budget for will-it-fit: one of these cards (24 GB = RTX 4090, ...)")
    memory.add_argument("-o", "--output", help="file to write (default: stdout)")


MIN_BUDGET_GIB, MAX_BUDGET_GIB = 0.01, 1_000_000  # the Memory tab's budget field's range (10 MiB to a million GiB)


def _memory_command(args: argparse.Namespace) -> str:

    from graphviz_core.analysis.memory_report import memory_report
    from graphviz_core.analysis.training_step import ACCELERATORS

    budget = None
    if args.budget_gib is not None:
        if not MIN_BUDGET_GIB <= args.budget_gib <= MAX_BUDGET_GIB:
            raise ValueError(f"--budget-gib takes a memory budget from {MIN_BUDGET_GIB} to {MAX_BUDGET_GIB:,} GiB, got "
                             f"{args.budget_gib:g}.")
        budget = int(args.budget_gib * 2**30)
    elif args.accelerator:
        budget = next(v for k, v in ACCELERATORS.items() if k.split(" (")[0] == args.accelerator)
    config = _config_of(args)
    report = memory_report(config, config.optimizer, args.checkpoints, budget)
    return _json({**report, "config": _config_echo(config)})


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=list(PRESETS), type=preset_named)  # a former name gives the preset it became
    for name, choices in CHOICE_FLAGS.items():
        parser.add_argument(f"--{name}", choices=choices, help=field_help(name))
    for name in TEXT_FLAGS:
        parser.add_argument(FIELDS[name].flag, dest=name, metavar="NAMES", help=field_help(name))
    for name in INT_FLAGS:
        parser.add_argument(FIELDS[name].flag, dest=name, type=whole_number,
                            help=field_help(name, zero=name not in ZERO_IS_DEFAULT))
    for name in SWITCH_FLAGS:
        parser.add_argument(FIELDS[name].flag, action=argparse.BooleanOptionalAction, default=None,
                            help=field_help(name))


def _add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    from graphviz_core.parallel.settings import MIXED_PRECISIONS, SCHEDULES, STRATEGIES

    group = parser.add_argument_group(
        "parallelism", "simulate rank 0 of a multi-GPU training step (torch FSDP2 / tensor parallel over a fake "
        "process group); with --format json the output gains `per_rank`")
    group.add_argument("--strategy", choices=STRATEGIES, help="none, ddp, fsdp, hsdp, tp or fsdp+tp")
    group.add_argument("--world-size", type=whole_number, help="ranks (GPUs) in total")
    group.add_argument("--tp", type=whole_number, help="tensor-parallel degree (tp: = world size; fsdp+tp: divides it)")
    group.add_argument("--shard-group", type=whole_number, help="hsdp: ranks that shard one model copy (e.g. 8, one node)")
    group.add_argument("--no-reshard-after-forward", action="store_true",
                       help="FSDP: keep each layer's gathered parameters from forward to backward (fewer all-gathers, "
                            "more memory); the root (embeddings, head) is kept either way, FSDP2's default")
    group.add_argument("--mixed-precision", choices=MIXED_PRECISIONS,
                       help="FSDP2 policy: bf16 (fp32 master shards, bf16 compute and reduce), bf16-fp32-reduce")
    group.add_argument("--pp", type=whole_number, help="pipeline-parallel ranks: the layers are split into stages "
                       "(torch.distributed.pipelining); the world size counts them, e.g. fsdp 8 x pp 4 = 32")
    group.add_argument("--microbatches", type=whole_number,
                       help="pipeline: microbatches the batch (per data-parallel rank) is split into (default pp x "
                            "stages per rank)")
    group.add_argument("--schedule", choices=SCHEDULES, help="pipeline: gpipe, 1f1b (default) or interleaved-1f1b")
    group.add_argument("--stages-per-rank", type=whole_number, help="interleaved-1f1b: stages each pipeline rank holds")
    group.add_argument("--cp", type=whole_number, help="context-parallel ranks: each holds s/cp of every sequence and attention "
                       "runs as torch's ring (context_parallel); with ddp, fsdp or fsdp+tp, whose data-parallel "
                       "group spans data x context ranks; the world size counts them")
    group.add_argument("--sequence-parallel", action="store_true", default=None,
                       help="with tp / fsdp+tp: norms run on s/tp tokens, projections all-gather their input and "
                            "reduce-scatter their output (Megatron sequence parallel)")


def _parallel_of(args: argparse.Namespace):
    """The ParallelConfig the flags ask for, or None when no parallelism flag was given."""
    from graphviz_core.parallel.settings import ParallelConfig

    pipeline = (args.pp, args.microbatches, args.schedule, args.stages_per_rank)
    given = (args.strategy, args.world_size, args.tp, args.shard_group, args.mixed_precision, *pipeline, args.cp,
             args.sequence_parallel)
    if all(v is None for v in given) and not args.no_reshard_after_forward:
        return None
    strategy = args.strategy or ("none" if args.pp is not None else None)  # --pp alone: one rank per stage
    if strategy is None:
        raise ValueError("parallelism flags need --strategy (none, ddp, fsdp, hsdp, tp or fsdp+tp).")
    if args.pp is None and any(v is not None for v in pipeline):
        raise ValueError("--microbatches, --schedule and --stages-per-rank are pipeline flags; add --pp.")

    def given_or(value, default):  # 0 is a value given (and refused by ParallelConfig), not "left out"
        return default if value is None else value

    tp, pp, per_rank, cp = (given_or(v, 1) for v in (args.tp, args.pp, args.stages_per_rank, args.cp))
    world = given_or(args.world_size, tp * pp if strategy in ("tp", "none") else cp * tp if cp > 1 else 1)
    return ParallelConfig(
        strategy=strategy, world_size=world, tp=tp, shard_group=given_or(args.shard_group, 0),
        reshard_after_forward=not args.no_reshard_after_forward, mixed_precision=args.mixed_precision or "none",
        pp=pp, microbatches=given_or(args.microbatches, pp * per_rank if pp > 1 else 1),
        schedule=args.schedule or "1f1b", stages_per_rank=per_rank, cp=cp,
        sequence_parallel=bool(args.sequence_parallel),
    )


# Whole-number flags whose field reads 0 as "not set" (the family's default): a 0 typed there is refused rather than
# echoed as 0 while the default is built (--intermediate 0 built 4 x hidden). --context 0 = seq is documented.
ZERO_IS_DEFAULT = {name: f.zero_typed for name, f in FIELDS.items() if f.zero_typed}


def _config_of(args: argparse.Namespace):
    for name, default in ZERO_IS_DEFAULT.items():
        if getattr(args, name) == 0:
            raise ValueError(f"{FIELDS[name].flag} 0 would be read as not set ({default}); give a value >= 1 "
                             "or leave the flag out.")
    for name in TEXT_FLAGS:
        value = getattr(args, name)
        if value is not None and not value.strip():
            example = "q_proj,v_proj" if name == "lora_targets" else "'*embed*'"
            raise ValueError(f"{FIELDS[name].flag} '' names nothing; give the names (e.g. {example}) or leave "
                             "the flag out for the default.")
    return resolve_config(args.preset, **{name: getattr(args, name) for name in CONFIG_FLAGS})


def _compare_command(args: argparse.Namespace) -> str:

    from graphviz_core.analysis.compare import compare_captures
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.capture.workers import capture_later

    b_parser = _OneLineParser(prog="graphviz-core compare ... --vs")
    _add_config_flags(b_parser)
    b_args = b_parser.parse_args(args.vs)
    if b_args.preset is None:  # B inherits A's flags, then overrides them
        for name in ("preset", *CONFIG_FLAGS):
            if getattr(b_args, name) is None:
                setattr(b_args, name, getattr(args, name))
    config_a, config_b = _config_of(args), _config_of(b_args)
    capture_b = capture_later(config_b)  # a meta dry run goes to a second process at once, beside A
    diff = compare_captures(capture_backward(config_a), capture_b()).to_dict()
    for side, config in (("a", config_a), ("b", config_b)):
        diff[side]["config"] = _config_echo(config)
    return _json(diff)


def _json(data: dict) -> str:
    """`data` as JSON any parser reads: a float that is not finite (NaN, inf: not JSON) is written as null, and the
    top-level `notes` list says where."""
    import json

    from graphviz_core.units import finite_or_null, some_of

    places: list[str] = []
    clean = finite_or_null(data, places)
    if places:
        clean["notes"] = [*clean.get("notes", []),
                          f"{some_of(places, 10)}: not a finite number (NaN or infinite), written as null."]
    return json.dumps(clean, indent=1, allow_nan=False)


def _config_echo(config) -> dict:
    """The config as the JSON echoes it: the fields its family takes (a ResNet has no heads or sequence length)."""
    return config.shown()


def _graph_command(args: argparse.Namespace) -> str | bytes:
    from graphviz_core.capture.engine import capture_backward
    from graphviz_core.export.formats import PNG_SIZE, png_problem, to_dot, to_graphml, to_svg

    if args.format == "png":  # refuse before a capture that could take minutes
        size = _png_size(args.png_size) if args.png_size is not None else None
        if problem := png_problem(*(size or PNG_SIZE), args.png_scale):
            raise ValueError(problem)
    parallel = None
    if args.model_file is not None:
        fields = {name: getattr(args, name) for name in (*CHOICE_FLAGS, *INT_FLAGS, "tied")}
        given = [f"--{k.replace('_', '-')}" for k, v in fields.items() if v is not None]
        given += ["--preset"] if args.preset else []
        if given:
            raise ValueError(f"--model-file brings its own model and inputs; drop {', '.join(given)}.")
        if _parallel_of(args) is not None:
            raise ValueError("parallelism flags simulate the built-in and Hugging Face models; drop them with --model-file.")
        capture = _capture_model_file(args.model_file, args.ctrl_c, compile=bool(args.compile))
    else:
        config = _config_of(args)
        parallel = _parallel_of(args)
        if parallel is not None:
            from graphviz_core.parallel.settings import check_parallel

            check_parallel(config, parallel)  # refuse a bad layout before the capture runs
        capture = capture_backward(config, progress=_phase_line if config.compile else None)  # compiling takes seconds
    if args.format == "json":

        from graphviz_core.export.formats import capture_to_dict

        out = {**capture_to_dict(capture), "config": _config_echo(capture.config)}
        if parallel is not None:
            from graphviz_core.parallel.pipeline import simulate_layout

            result = simulate_layout(config, parallel)
            out["per_rank"] = result.to_dict()
            if result.pipeline is not None:  # pipeline rank 0 above; every stage here
                out["pipeline"] = result.pipeline.to_dict()
                out["per_stage"] = [stage.to_dict() for stage in result.pipeline.per_stage]
        return _json(out)
    if args.format == "graphml":
        return to_graphml(capture.graph)
    if args.format == "dot":
        return to_dot(capture.graph)
    if args.format == "svg":
        return to_svg(capture.graph)
    from graphviz_core.export.render import render_standalone_html

    if args.format == "png":  # laid out as the app's PNG downloads: layers top to bottom
        from graphviz_core.export.formats import to_png
        from graphviz_core.export.render import standalone_png_page

        page, height = standalone_png_page(capture)
        width, height = size or (PNG_SIZE[0], height)
        return to_png(page, width=width, height=height, scale=args.png_scale)
    return render_standalone_html(capture)


PNG_SIDE_PIXELS = (100, 8000)  # what graphviz_core.export.formats.png_problem accepts (a test holds the two together)


def _png_size(text: str) -> tuple[int, int]:
    """'1600x1000' -> (1600, 1000); a sentence that states the range for anything else (png_problem refuses sizes
    outside it, also with the range)."""
    match = re.fullmatch(r"\s*(\d{1,9})\s*[xX×]\s*(\d{1,9})\s*", text)
    if not match:
        low, high = PNG_SIDE_PIXELS
        raise ValueError(f"--png-size takes WIDTHxHEIGHT in CSS pixels, each side {low}..{high} (e.g. 1600x1000), "
                         f"not {text!r}.")
    return int(match.group(1)), int(match.group(2))


class _CtrlC:
    """Whether a SIGINT really arrived: a KeyboardInterrupt without one was raised by code (a user's model)."""

    arrived = False


@contextlib.contextmanager
def _noting_ctrl_c() -> Iterator[_CtrlC]:
    """Notes a real Ctrl-C, then interrupts as Python's own handler does. Only the main thread may set a signal
    handler; elsewhere (or where SIGINT is ignored) nothing is noted and nothing changes."""
    noted = _CtrlC()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield noted
        return

    def note(signum, frame):
        noted.arrived = True
        if callable(previous):
            return previous(signum, frame)  # Python's default_int_handler raises KeyboardInterrupt
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    try:
        yield noted
    finally:
        signal.signal(signal.SIGINT, previous)


def _capture_model_file(spec: str, ctrl_c: _CtrlC, compile: bool = False):
    """`--model-file PATH:FACTORY`, loaded and captured; the user's code stopping the program instead of returning
    (KeyboardInterrupt without a Ctrl-C, sys.exit(), another BaseException) becomes one sentence (a ValueError).

    A KeyboardInterrupt is the user's Ctrl-C when a SIGINT really arrived (`ctrl_c`, noted by main); that one still
    interrupts, wherever it lands."""
    from graphviz_core.capture.own_module import capture_module
    from graphviz_core.models.model_files import load_factory, user_code_apart

    factory = spec.rpartition(":")[2]
    phase = f"while loading it (importing the file and calling {factory}())"
    try:
        with user_code_apart() as report:
            model, inputs, loss_fn = load_factory(spec)
            phase = "during the capture (forward, loss and backward)"
            capture = capture_module(model, inputs, loss_fn, name=spec, compile=compile,
                                     progress=_phase_line if compile else None)
    except Exception:
        raise
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) and ctrl_c.arrived:
            raise
        raise ValueError(_stopped_sentence(spec, exc, phase)) from None
    _say_what_it_did(spec, report)
    return capture


_LEFT_RUNNING: list[threading.Thread] = []  # a model file's non-daemon threads still running: main does not wait


def _say_what_it_did(spec: str, report) -> None:
    """A note on stderr for each thing a model file did to the process (its output is kept apart from ours)."""
    if report.printed:
        _say(f"graphviz-core: note: {spec} printed {report.printed:,} characters; they went to stderr, so stdout holds "
             "only graphviz-core's output.")
    if report.replaced:
        _say(f"graphviz-core: note: {spec} replaced {' and '.join(report.replaced)}; graphviz-core put its own back.")
    if report.threads:
        _LEFT_RUNNING.extend(report.threads)
        names = ", ".join(t.name for t in report.threads[:5])
        _say(f"graphviz-core: note: {spec} started {len(report.threads)} thread(s) still running ({names}); "
             "graphviz-core writes its output and exits without waiting for them.")


def _stopped_sentence(spec: str, exc: BaseException, phase: str) -> str:
    from graphviz_core.models.model_files import ExitCalled, first_line

    if isinstance(exc, SystemExit):
        code = "" if exc.code is None else _short(repr(exc.code), 40)
        what = f"called sys.exit({code}) {phase}"
    elif isinstance(exc, ExitCalled):
        what = f"called os._exit({_short(repr(exc.code), 40)}) {phase}"
    else:
        what = f"raised {type(exc).__name__} {phase}" + (f": {first_line(exc)}" if str(exc).strip() else "")
    return f"{spec} {what}; a model file must return its model, not stop the program."


def _expr_command(args: argparse.Namespace) -> str:

    from graphviz_core.toy.expressions import parse_assignments, parse_expression, trace_expression, variables_of

    values = parse_assignments(args.values)
    variables = variables_of(parse_expression(args.expression))
    if unused := [name for name in values if name not in variables]:
        has = f"its variables are {', '.join(variables)}" if variables else "it has no variables"
        listed = " and ".join(", ".join(f"{n}={values[n]:g}" for n in unused).rsplit(", ", 1))
        one = len(unused) == 1
        raise ValueError(f"{listed} {'is not a variable' if one else 'are not variables'} of the expression ({has}); "
                         f"drop {'it' if one else 'them'}.")
    trace = trace_expression(args.expression, values)
    # NaN/inf are not JSON: to_json_dict writes them as null and says where, in "notes"
    return _json(trace.to_json_dict())


def _phase_line(phase: str) -> None:
    """A capture's phases on stderr, for the slow ones (--compile): stdout stays the result alone."""
    _say(f"graphviz-core: {phase}")


# A quoted value as repr writes it: a quote that opens after no letter or digit (not the apostrophe of "model's"),
# up to the first quote of its kind that no letter or digit follows. Matched left to right, every value in turn: a
# pattern for long values alone took the text between two short values for one ("'*x*' matches ... names '").
_QUOTED = re.compile(r"(?<!\w)(['\"])(.*?)\1(?!\w)")


def _say(line: str) -> None:
    """The one line a user sees on stderr, with a very long number or quoted value cut short (a 5,000-digit seed)."""
    line = re.sub(r"\d{30,}", lambda m: _short(m[0], 20), line)
    line = _QUOTED.sub(lambda m: m[1] + _short(m[2], 60) + m[1] if len(m[2]) >= 100 else m[0], line)
    sys.stderr.write(line.rstrip("\n") + "\n")


def _short(text: str, keep: int) -> str:
    """`text`, or its first `keep` characters and how long it was."""
    if len(text) <= keep:
        return text
    unit = "digits" if text.isdigit() else "characters"
    return f"{text[:keep]}… ({len(text):,} {unit})"


def _negatives_joined(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--gpu-memory -80GiB` as `--gpu-memory=-80GiB`: argparse takes a value that starts with '-' for an option
    unless it is a plain negative number, and said "expected one argument" instead of what is wrong with the value."""
    takes_one = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                takes_one |= {o for a in sub._actions if isinstance(a, argparse._StoreAction) and a.nargs is None
                              for o in a.option_strings if o.startswith("--")}
    out: list[str] = []
    for token in argv:
        if out and out[-1] in takes_one and re.match(r"-\.?[0-9]", token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    _LEFT_RUNNING.clear()
    with _noting_ctrl_c() as ctrl_c:
        try:
            code = _main(argv, ctrl_c)
        except KeyboardInterrupt:
            if not ctrl_c.arrived:
                raise  # not a Ctrl-C, nor from a model file (those are sentences): a bug to see whole
            _say("graphviz-core: interrupted (Ctrl-C).")
            return EXIT_INTERRUPTED
    if argv is None and any(t.is_alive() for t in _LEFT_RUNNING):  # the command line: Python would wait for them
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: Sequence[str] | None, ctrl_c: _CtrlC) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["debug"]:  # gradient-flow findings (graphviz_core.cli_debug)
        from graphviz_core.cli_debug import main as debug_main

        return debug_main(argv, (_add_config_flags, _config_of, CONFIG_FLAGS))
    if argv[:1] in (["record"], ["recording"]):  # a user's training loop recorded, and read (graphviz_core.cli_record)
        from graphviz_core.cli_record import main as record_main

        return record_main(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(_negatives_joined(argv, parser))
        args.ctrl_c = ctrl_c
        commands = {"graph": _graph_command, "expr": _expr_command, "compare": _compare_command,
                    "memory": _memory_command, "plan": _plan_command}
        text = commands[args.command](args)
    except _BadInput as exc:
        _say(str(exc))
        return EXIT_BAD_INPUT
    except ValueError as exc:  # config, capture and expression errors a user can fix
        _say(f"graphviz-core: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        return EXIT_BAD_INPUT
    if args.output:
        try:
            if isinstance(text, bytes):  # --format png
                with open(args.output, "wb") as f:
                    f.write(text)
            else:
                with open(args.output, "w", encoding="utf-8") as f:
                    f.write(text)
        except OSError as exc:
            _say(f"graphviz-core: cannot write {args.output}: {exc.strerror or exc}")
            return EXIT_BAD_INPUT
    elif isinstance(text, bytes):
        sys.stdout.flush()
        sys.stdout.buffer.write(text)
        sys.stdout.buffer.flush()
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0
