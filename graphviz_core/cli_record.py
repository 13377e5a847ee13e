"""`graphviz-core record` and `graphviz-core recording`: a user's training script recorded unchanged, and a
recording printed as JSON (docs/recording.md). graphviz_core.cli hands these two subcommands here.

    graphviz-core record --steps N -o PATH SCRIPT [SCRIPT_ARGS...]   everything after SCRIPT is the script's
    graphviz-core recording PATH --format json [-o FILE]
    graphviz-core recording PATH --format tensorboard -o FOLDER      TensorBoard event files (export.recording_export)
    graphviz-core recording PATH --format chrome-trace [-o FILE]     per-node backward times, Perfetto / chrome://tracing

Bad input (a missing script, a bad --steps, a folder that already holds a recording, a recording that cannot be read)
is one sentence on stderr and exit 2. The script runs as `python SCRIPT ARGS` would (as `python -m cProfile` runs
it): its own exit code is returned, and an exception it raises prints its traceback (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import sys
import traceback
import warnings
from collections.abc import Sequence

EXIT_BAD_INPUT = 2


def whole_number(text: str) -> int:
    """A flag's whole number written with the digits 0-9 (Python's int() also reads other scripts' digits: '٢' is 2);
    every command's whole-number flags take it."""
    if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):
        raise argparse.ArgumentTypeError(f"takes a whole number written with the digits 0-9, got {text!r}")
    if len(text.strip()) > 4000:  # int() reads at most 4,300 digits
        raise argparse.ArgumentTypeError(f"takes a whole number of at most 4,000 digits, got {text.strip()!r}")
    return int(text)


class Refused(Exception):
    """Bad input: one sentence for stderr, exit 2 (cli_record and cli_debug)."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise Refused(f"{self.prog}: {message} (see --help)")


def _parser(command: str) -> argparse.ArgumentParser:
    if command == "record":
        parser = Parser(prog="graphviz-core record",
                         description="Run a training script unchanged and record its backward passes and optimizer "
                                     "steps into a folder (docs/recording.md).")
        parser.add_argument("--steps", type=whole_number, default=None,
                            help="record this many optimizer steps, then let the script run on unrecorded "
                                 "(default: every step)")
        parser.add_argument("-o", "--output", required=True, help="the folder to write the recording in (new)")
        parser.add_argument("--parameters-only", action="store_true",
                            help="record the per-step and per-parameter figures only, no per-node figures (cheaper)")
        parser.add_argument("--nodes-every", type=whole_number, default=1, metavar="N",
                            help="per-node figures on every N-th step only (0, N, 2N, ...), the per-step and "
                                 "per-parameter figures on every step (default 1: every step; docs/recording.md)")
        parser.add_argument("--check-forward", action="store_true",
                            help="check every op of the forward for NaN and inf and keep each node's forward source "
                                 "line (costs more; docs/debugging.md)")
        parser.add_argument("--eager", action="store_true",
                            help="run the script's torch.compile'd code eagerly (torch.compiler.set_stance("
                                 "'force_eager')): the eager replay of a compiled loop, each op its own node, to "
                                 "name the op where a finding sits in a compiled region (docs/debugging.md)")
        parser.add_argument("script", help="the Python script to run")
        parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
        return parser
    parser = Parser(prog="graphviz-core recording", description="Print a recording (docs/recording.md).")
    parser.add_argument("path", help="the recording's folder")
    parser.add_argument("--format", choices=("json", "tensorboard", "chrome-trace"), default="json",
                        help="json (the recording's figures), tensorboard (event files in the -o folder: scalars and "
                             "histograms) or chrome-trace (per-node backward times for Perfetto / chrome://tracing)")
    parser.add_argument("-o", "--output", help="file to write (default: stdout); for tensorboard, the folder (required)")
    return parser


def main(argv: Sequence[str]) -> int:
    """`argv` starts with `record` or `recording`."""
    command, rest = argv[0], list(argv[1:])
    try:
        args = _parser(command).parse_args(rest)
        if command == "record":
            return _record(args)
        return _recording(args)
    except (Refused, ValueError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        sys.stderr.write((message if message.startswith("graphviz-core") else f"graphviz-core: {message}") + "\n")
        return EXIT_BAD_INPUT


def named(value: str | None, flag: str, what: str) -> None:
    """Refuse '' (or spaces) typed for `flag`: a value, never read as "not given" (docs/cli.md); '' as a path is the
    current folder, where `record -o ''` wrote its recording."""
    if value is not None and not value.strip():
        raise ValueError(f"{flag} {value!r} names nothing; give {what}.")


def reading(args: argparse.Namespace) -> None:
    """`recording` and `debug`: refuse '' for the recording's folder and for -o (named)."""
    named(args.path, "the recording's folder", "the folder graphviz-core record wrote")
    named(args.output, "-o", "the file to write (or leave -o out for standard output)")


def json_text(value, indent: int | None = None) -> str:
    """`value` as JSON; a NaN or infinity left where the reader gives a number (every figure that may be one is
    written by its name, or null) is a damaged recording, one sentence."""
    try:
        return json.dumps(value, indent=indent, allow_nan=False)
    except ValueError:
        raise ValueError("the recording holds a NaN or infinity where a figure should be a number (a step's scale "
                         "or time); it is damaged.") from None


def _record(args: argparse.Namespace) -> int:
    named(args.output, "-o", "the folder to write the recording in")
    script = args.script
    if not os.path.isfile(script):
        raise ValueError(f"{script} is not a file; give the path of the Python script to run.")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps {args.steps} records nothing; give 1 or more (or leave it out for every step).")
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args  # `SCRIPT -- ARGS` works too
    from graphviz_core.capture.recorder import UnclosedSteps, record

    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnclosedSteps)  # said below as one sentence, not as a warning's two lines
            with record(args.output, steps=args.steps, nodes=not args.parameters_only,
                        check_forward=args.check_forward, nodes_every=args.nodes_every, eager=args.eager) as rec:
                try:
                    runpy.run_path(script, run_name="__main__")
                except SystemExit as exit_:
                    code = exit_.code
                    if code not in (None, 0):
                        raise _ScriptExit(code) from None
        if rec.active and rec.backwards:
            sys.stderr.write(f"graphviz-core: {rec.unclosed()}\n")
    except _ScriptExit as exit_:
        code = exit_.code
        if isinstance(code, int):
            return code
        sys.stderr.write(f"{code}\n")  # sys.exit("message"): python prints it and exits 1
        return 1
    except Exception:  # the script's own error: its traceback, as python would print it
        if isinstance(sys.exc_info()[1], ValueError) and not _from_script(sys.exc_info()[2], script):
            raise
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


class _ScriptExit(Exception):
    def __init__(self, code) -> None:
        super().__init__(code)
        self.code = code


def _from_script(tb, script: str) -> bool:
    """Whether the traceback passes through the user's script (else it is the recorder's own refusal)."""
    target = os.path.abspath(script)
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == target:
            return True
        tb = tb.tb_next
    return False


def _recording(args: argparse.Namespace) -> int:
    from graphviz_core.graph.recording import open_recording

    reading(args)
    if args.format == "tensorboard" and not args.output:
        raise ValueError("--format tensorboard writes event files into a folder: give it with -o FOLDER.")
    recording = open_recording(args.path)
    if args.format == "tensorboard":
        from graphviz_core.export.recording_export import to_tensorboard

        written = to_tensorboard(recording, args.output)
        sys.stdout.write(f"wrote {len(written)} event file(s) under {args.output}; open with: tensorboard --logdir "
                         f"{args.output}\n")
        return 0
    if args.format == "chrome-trace":
        from graphviz_core.export.recording_export import to_chrome_trace

        text = json_text(to_chrome_trace(recording))
    else:
        text = json_text(recording.to_dict(), indent=1)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as exc:
            raise ValueError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    else:
        sys.stdout.write(text + "\n")
    return 0
