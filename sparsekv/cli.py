"""The `sparsekv` command line: `sparsekv <command> [options]`.

Each command is an entry of `COMMANDS`: a function adding its options to a subparser and a function running it
with the parsed arguments. Add a command (e.g. `bench`) by adding an entry.
"""

from __future__ import annotations

import argparse
import sys
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


def placement_args(parser: argparse.ArgumentParser) -> None:
    """`--device`, `--dtype`, `--device-map` and `--attn-implementation`, the same for demo, eval and bench."""
    from .models import DTYPES

    add = parser.add_argument
    add("--device", default="auto", help="torch device: auto (CUDA when available, else CPU), cpu, cuda, cuda:1 "
        "(default: %(default)s)")
    add("--dtype", choices=DTYPES, default="auto",
        help="auto: bfloat16 on a GPU, float32 on a CPU (default: %(default)s)")
    add("--device-map", help="accelerate device map for models larger than one device, e.g. auto (replaces --device)")
    add("--attn-implementation", choices=("sdpa", "eager", "flash_attention_2"), default="sdpa",
        help="(default: %(default)s)")


def placement(args: argparse.Namespace):
    """`(device_map, dtype)` from the parsed placement options; bad values exit through `args.parser.error`."""
    from .models import placement as resolve

    try:
        device, dtype = resolve(args.device, args.dtype)
    except ValueError as err:
        args.parser.error(str(err))
    return (args.device_map or device), dtype


def _demo_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="model alias, .gguf file or directory (default: %(default)s)")
    add("--tokens", type=_int_at_least(64), default=2000, help="prompt length in tokens, >= 64 (default: %(default)s)")
    add("--ratio", type=_fraction(zero_allowed=False), default=0.1,
        help="fraction of the prompt's KV kept, in (0, 1] (default: %(default)s)")
    add("--max-new-tokens", type=_int_at_least(1), default=16, help="tokens generated (default: %(default)s)")
    add("--depth", type=_fraction(zero_allowed=True), default=0.5, help="needle depth in [0, 1] (default: %(default)s)")
    placement_args(parser)


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .models import MODELS

    spec = MODELS.get(args.model)
    if spec is not None and args.tokens + args.max_new_tokens > spec.context_length:
        args.parser.error(
            f"--tokens + --max-new-tokens = {args.tokens + args.max_new_tokens} exceeds the context of "
            f"{args.model} ({spec.context_length} tokens)"
        )
    device_map, dtype = placement(args)
    run_demo(args.model, n_tokens=args.tokens, ratio=args.ratio, max_new_tokens=args.max_new_tokens, depth=args.depth,
             dtype=dtype, attn_implementation=args.attn_implementation, device_map=device_map)
    return 0


def _csv(item_type: Callable[[str], object]) -> Callable[[str], list]:
    """An argparse type: a comma-separated list of `item_type` values."""

    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError("give at least one value")
        return [item_type(item) for item in items]

    return parse


def press_specs(text: str) -> list[str]:
    """An argparse type: comma-separated press specs, each with its options (`chunkkv:ratio=0.1,reuse_layers=1`)."""
    from .presses.registry import split_specs

    specs = split_specs(text)
    if not specs:
        raise argparse.ArgumentTypeError("give at least one press")
    return specs


# --- eval ------------------------------------------------------------------------------------------------------
def _eval_args(parser: argparse.ArgumentParser) -> None:
    from .evaluation import TASKS, known_presses

    add = parser.add_argument
    add("--model", default="smollm2-135m",
        help="alias (smollm2-135m, qwen2.5-0.5b), .gguf file, model folder or Hub id (default: %(default)s)")
    add("--tasks", type=_csv(str), default=list(TASKS),
        help=f"comma-separated: {', '.join(TASKS)}, or ruler:<task> / longbench:<task> from the Hub "
        "(default: every local task)")
    add("--presses", type=press_specs, default=["snapkv", "h2o", "streamingllm", "chunkkv"],
        help=f"comma-separated, of: {known_presses()} (default: snapkv,h2o,streamingllm,chunkkv; the full "
        "cache is added unless --no-full); options after the name: chunkkv:reuse_layers=1")
    kept = parser.add_mutually_exclusive_group()
    kept.add_argument("--ratios", type=_csv(_fraction(zero_allowed=False)), default=[0.5, 0.25, 0.1],
                      help="fractions of the KV kept, each in (0, 1] (default: 0.5,0.25,0.1)")
    kept.add_argument("--budgets", type=_csv(_int_at_least(1)), help="tokens of KV kept, instead of --ratios")
    add("--lengths", type=_csv(_int_at_least(16)), default=[4096],
        help="prompt lengths in model tokens, chat template included (default: 4096)")
    add("--samples", type=_int_at_least(1), default=20, help="samples per task and length (default: %(default)s)")
    add("--mode", choices=("question", "agnostic", "both"), default="question",
        help="question: context and question compressed together; agnostic: the context compressed alone, "
        "then the question answered from it; both (default: %(default)s)")
    add("--out", default="results", help="results folder; finished runs in it are skipped (default: %(default)s)")
    add("--seed", type=_int_at_least(0), default=0, help="seed of the generated samples (default: %(default)s)")
    add("--max-new-tokens", type=_int_at_least(1), help="tokens generated per answer (default: each task's own)")
    add("--haystack", help="a text file whose sentences replace the noise haystack")
    add("--no-full", action="store_true", help="do not run the full-cache reference")
    placement_args(parser)


def _eval(args: argparse.Namespace) -> int:
    from .evaluation import EvalConfig, format_report, load_and_evaluate
    from .evaluation.runner import check_model_name
    from .models import MODELS

    try:
        config = EvalConfig(
            model=args.model, tasks=args.tasks, presses=args.presses, ratios=args.ratios, budgets=args.budgets,
            lengths=args.lengths, samples=args.samples, mode=args.mode, out=args.out, seed=args.seed,
            max_new_tokens=args.max_new_tokens, haystack=args.haystack, full=not args.no_full,
        )
        check_model_name(args.model)
        if args.haystack:
            from .evaluation.tasks import read_haystack

            read_haystack(args.haystack)
        spec = MODELS.get(args.model)
        if spec is not None and max(args.lengths) > spec.context_length:
            raise ValueError(f"--lengths: {max(args.lengths)} exceeds the context of {args.model} "
                             f"({spec.context_length} tokens)")
        device_map, dtype = placement(args)
        if args.device == "auto" and not args.device_map:
            device_map = None  # each accelerate process on its own device, or the one device there is
        results = load_and_evaluate(config, device_map=device_map, dtype=dtype,
                                    attn_implementation=args.attn_implementation)
    except ValueError as err:
        args.parser.error(str(err))
    if results:
        print(format_report(results))
    return 0


# --- report ----------------------------------------------------------------------------------------------------
def _report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results_dir", metavar="RESULTS_DIR", help="the --out folder of sparsekv eval")
    parser.add_argument("--plot", help="PNG to write (default: RESULTS_DIR/accuracy.png)")
    parser.add_argument("--format", choices=("text", "md", "csv", "json"), default="text",
                        help="text or md: a table per task family; csv or json: one record per run, with its "
                        "95%% interval (default: %(default)s)")


def _report(args: argparse.Namespace) -> int:
    import pathlib

    from .evaluation import format_report, load_results, plot

    try:
        results = load_results(args.results_dir)
    except ValueError as err:
        args.parser.error(str(err))
    print(format_report(results, args.format))
    path = plot(results, args.plot or pathlib.Path(args.results_dir) / "accuracy.png")
    if args.format in ("text", "md"):  # csv and json stay parseable
        print(f"plot: {path}")
    return 0


def _bench_args(parser: argparse.ArgumentParser) -> None:
    from .bench import add_arguments  # imported when used: it pulls in the benchmark's dependencies

    add_arguments(parser)


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_command

    return run_command(args)


# name -> (help, add arguments, run)
COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "demo": ("needle-in-a-haystack demo: full cache vs each press", _demo_args, _demo),
    "eval": ("RULER-style long-context evaluation: tasks x presses x ratios x lengths", _eval_args, _eval),
    "report": ("table and plot of the results of sparsekv eval", _report_args, _report),
    "bench": ("prefill and decode latency, memory and KV: presses vs the full cache and the oracle",
              _bench_args, _bench),
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="sparsekv", description="KV-cache compression presses for transformers.")
    parser.add_argument("--version", action="version", version=f"sparsekv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, (help_text, add_args, run) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        add_args(sub)
        sub.set_defaults(run=run, parser=sub)  # a command reports bad arguments with args.parser.error
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`) and run the command; returns the exit code."""
    from .models import ModelFetchError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ModelFetchError as err:  # e.g. the package index is unreachable: the message says what to do
        print(f"sparsekv: {err}", file=sys.stderr)
        return 1
