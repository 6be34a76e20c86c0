"""The `sparsekv` command line: `sparsekv <command> [options]`.

Each command is a module of this package with `HELP`, `add_arguments(parser)`, `needs(args)` (the optional
modules it will use, checked before it starts: `args.check_extras`) and `run(args)` (what the commands share:
`sparsekv.cli.args`). Building the parser imports only the argument definitions, no torch, so `--help` is
quick; a command imports what it needs when it runs. Add a command by adding its module to `COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .args import check_extras
from .args import placement, placement_args  # noqa: F401 (the benchmarks' scripts take the same options)

# command -> its module
COMMANDS = {"demo": "demo", "eval": "evaluate", "report": "report", "bench": "bench"}


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="sparsekv", description="KV-cache compression presses for transformers.")
    parser.add_argument("--version", action="version", version=f"sparsekv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, module in COMMANDS.items():
        command = importlib.import_module(f".{module}", __name__)
        sub = subparsers.add_parser(name, help=command.HELP, description=command.HELP)
        command.add_arguments(sub)
        # (a command reports bad arguments with args.parser.error)
        sub.set_defaults(run=command.run, needs=command.needs, parser=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`) and run the command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from ..models import ModelFetchError

    check_extras(args, args.needs(args))  # before any work: a missing extra is not found after a long sweep
    try:
        return args.run(args)
    except ModelFetchError as err:  # e.g. the package index is unreachable: the message says what to do
        print(f"sparsekv: {err}", file=sys.stderr)
        return 1
