"""`sparsekv report`: the table and plot of a `sparsekv eval` results folder."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from .args import MATPLOTLIB, PANDAS, Need

HELP = "table and plot of the results of sparsekv eval"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results_dir", metavar="RESULTS_DIR", help="the --out folder of sparsekv eval")
    parser.add_argument("--plot", help="PNG to write (needs sparsekv[plot]; default: RESULTS_DIR/accuracy.png when "
                        "matplotlib is installed)")
    parser.add_argument("--format", choices=("text", "md", "csv", "json"), default="text",
                        help="text or md: a table per task family; csv or json: one record per run, with its "
                        "95%% interval (default: %(default)s)")


def needs(args: argparse.Namespace) -> list[Need]:
    return [PANDAS, *([MATPLOTLIB] if args.plot else [])]  # the default plot is drawn when it can be


def run(args: argparse.Namespace) -> int:
    import pathlib

    from ..evaluation import format_report, load_results, plot

    try:
        results = load_results(args.results_dir)
    except ValueError as err:
        args.parser.error(str(err))
    print(format_report(results, args.format))
    path = args.plot or pathlib.Path(args.results_dir) / "accuracy.png"
    if args.plot is None and importlib.util.find_spec("matplotlib") is None:
        # (on standard error: csv and json on standard output stay parseable)
        print(f"sparsekv: no plot drawn: pip install 'sparsekv[plot]' to draw {path}.", file=sys.stderr)
        return 0
    path = plot(results, path)
    if args.format in ("text", "md"):  # csv and json stay parseable
        print(f"plot: {path}")
    return 0
