"""The `sparsekv` command line: `sparsekv <command> [options]`.

Each command is an entry of `COMMANDS`: a function adding its options to a subparser and a function running it
with the parsed arguments. Add `eval`, `bench` or `report` by adding an entry.
"""

from __future__ import annotations

import argparse
from typing import Callable


def _fraction(zero_allowed: bool) -> Callable[[str], float]:
    """An argparse type: a float in (0, 1], or [0, 1] when `zero_allowed`."""
    interval = "[0, 1]" if zero_allowed else "(0, 1]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (0 <= value <= 1 if zero_allowed else 0 < value <= 1):
            raise argparse.ArgumentTypeError(f"must be in {interval}; got {value}")
        return value

    return parse


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}; got {value}")
        return value

    return parse


# --- demo ------------------------------------------------------------------------------------------------------
def _demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, .gguf file or directory (default: %(default)s)")
    parser.add_argument("--tokens", type=_int_at_least(64), default=2000, help="prompt length in tokens, >= 64 (default: %(default)s)")
    parser.add_argument("--ratio", type=_fraction(zero_allowed=False), default=0.1, help="fraction of the prompt's KV kept, in (0, 1] (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=_int_at_least(1), default=16, help="tokens generated (default: %(default)s)")
    parser.add_argument("--depth", type=_fraction(zero_allowed=True), default=0.5, help="needle depth in [0, 1] (default: %(default)s)")


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .models import MODELS

    spec = MODELS.get(args.model)
    if spec is not None and args.tokens + args.max_new_tokens > spec.context_length:
        args.parser.error(
            f"--tokens + --max-new-tokens = {args.tokens + args.max_new_tokens} exceeds the context of "
            f"{args.model} ({spec.context_length} tokens)"
        )
    run_demo(args.model, n_tokens=args.tokens, ratio=args.ratio, max_new_tokens=args.max_new_tokens, depth=args.depth)
    return 0


# name -> (help, add arguments, run)
COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "demo": ("needle-in-a-haystack demo: full cache vs each press", _demo_args, _demo),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsekv", description="KV-cache compression presses for transformers.")
    subparsers = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, (help_text, add_args, run) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        add_args(sub)
        sub.set_defaults(run=run, parser=sub)  # a command reports bad arguments with args.parser.error
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`) and run the command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args)
