"""`graphviz-core debug`: the gradient-flow findings (docs/debugging.md) of a recording, or of one step of a preset.

    graphviz-core debug PATH --format json [-o FILE]                              a recording (graphviz_core.record)
    graphviz-core debug --preset NAME [config flags] [--check-forward] --format json [-o FILE]     one step, recorded

Prints `{"findings": [...], "steps": [...]}` (analysis.gradient_flow); exit 0 whether or not something was found,
exit 2 with one sentence on stderr for bad input. graphviz_core.cli hands the subcommand here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from graphviz_core.cli_record import EXIT_BAD_INPUT, Parser, Refused, json_text, reading


def _parser(add_config_flags) -> argparse.ArgumentParser:
    parser = Parser(prog="graphviz-core debug",
                     description="Gradient-flow findings: where a NaN or inf started, parameters that got no "
                                 "gradient and why, dead units, vanishing and exploding gradients, the scaler's "
                                 "skipped steps (docs/debugging.md). Give a recording's folder, or --preset and "
                                 "config flags for one step of that model.")
    parser.add_argument("path", nargs="?", help="a recording's folder (graphviz-core record, graphviz_core.record)")
    add_config_flags(parser)
    parser.add_argument("--check-forward", action="store_true",
                        help="with --preset: check every op of the forward for NaN and inf and keep each node's "
                             "source line (a recording's forward was checked, or not, when it was recorded)")
    parser.add_argument("--format", choices=("json",), default="json")
    parser.add_argument("-o", "--output", help="file to write (default: stdout)")
    return parser


def main(argv: Sequence[str], config_flags: tuple) -> int:
    """`argv` starts with `debug`; `config_flags` is graphviz_core.cli's (add the flags, the config they give, their
    names), handed over so that this module does not import the one that imports it."""
    add_config_flags, config_of, names = config_flags
    try:
        args = _parser(add_config_flags).parse_args(list(argv[1:]))
        reading(args)
        text = json_text(_run(args, config_of, names), indent=1)
    except (Refused, ValueError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        sys.stderr.write((message if message.startswith("graphviz-core") else f"graphviz-core: {message}") + "\n")
        return EXIT_BAD_INPUT
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as exc:
            sys.stderr.write(f"graphviz-core: cannot write {args.output}: {exc.strerror or exc}\n")
            return EXIT_BAD_INPUT
    else:
        sys.stdout.write(text + "\n")
    return 0


def _run(args: argparse.Namespace, config_of, names) -> dict:
    from graphviz_core.analysis.gradient_flow import analyse
    from graphviz_core.graph.recording import open_recording

    flags = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) is not None]
    if args.path is not None:
        if args.preset is not None or flags:
            raise ValueError(f"give a recording's folder or --preset with config flags, not both (got {args.path} "
                             f"and {args.preset and '--preset' or flags[0]}).")
        if args.check_forward:
            raise ValueError("--check-forward applies to --preset; a recording's forward was checked when it was "
                             "recorded (graphviz-core record --check-forward, or record(..., check_forward=True)).")
        return analyse(open_recording(args.path))
    if args.preset is None and args.model is None:  # --model with its flags, as graph takes it, or a preset
        raise ValueError("give a recording's folder (graphviz-core debug PATH) or a model (--preset NAME, or --model "
                         "NAME with its flags).")
    if args.optimizer is not None:
        raise ValueError("debug of a preset runs one forward and backward, no optimizer step; leave out --optimizer "
                         "(record your own loop to see its steps).")
    from graphviz_core.analysis.gradient_flow import analyse_config

    config = config_of(args)
    result = analyse_config(config, check_forward=args.check_forward)
    result["config"] = config.shown()
    return result
