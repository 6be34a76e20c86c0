"""`sparsekv report`: the table and plot of a `sparsekv eval` results folder."""

from __future__ import annotations

import argparse

HELP = "table and plot of the results of sparsekv eval"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results_dir", metavar="RESULTS_DIR", help="the --out folder of sparsekv eval")
    parser.add_argument("--plot", help="PNG to write (default: RESULTS_DIR/accuracy.png)")
    parser.add_argument("--format", choices=("text", "md", "csv", "json"), default="text",
                        help="text or md: a table per task family; csv or json: one record per run, with its "
                        "95%% interval (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    import pathlib

    from ..evaluation import format_report, load_results, plot

    try:
        results = load_results(args.results_dir)
    except ValueError as err:
        args.parser.error(str(err))
    print(format_report(results, args.format))
    path = plot(results, args.plot or pathlib.Path(args.results_dir) / "accuracy.png")
    if args.format in ("text", "md"):  # csv and json stay parseable
        print(f"plot: {path}")
    return 0
