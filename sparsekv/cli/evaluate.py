"""`sparsekv eval`: RULER-style long-context tasks, swept over presses and budgets."""

from __future__ import annotations

import argparse

from .args import (
    MODEL_HELP,
    PANDAS,
    PRESSES_HELP,
    TASK_NAMES,
    Need,
    csv,
    fraction,
    int_at_least,
    model_needs,
    placement,
    placement_args,
    press_specs,
)

HELP = "RULER-style long-context evaluation: tasks x presses x ratios x lengths"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2-135m", help=MODEL_HELP)
    add("--tasks", type=csv(str), default=list(TASK_NAMES),
        help=f"comma-separated: {', '.join(TASK_NAMES)}; ruler (RULER's configuration: its first 11 names), "
        "or ruler:<task> / longbench:<task> from the Hub (default: every local task)")
    add("--presses", type=press_specs, default=["snapkv", "h2o", "streamingllm", "chunkkv"],
        help=f"{PRESSES_HELP} (default: snapkv,h2o,streamingllm,chunkkv; the full cache is added unless --no-full)")
    kept = parser.add_mutually_exclusive_group()
    kept.add_argument("--ratios", type=csv(fraction(zero_allowed=False)), default=[0.5, 0.25, 0.1],
                      help="fractions of the KV kept, each in (0, 1] (default: 0.5,0.25,0.1)")
    kept.add_argument("--budgets", type=csv(int_at_least(1)),
                      help="tokens of KV kept (CHESS: its read_budget, tokens a step reads), instead of --ratios")
    add("--lengths", type=csv(int_at_least(16)), default=[4096],
        help="prompt lengths in model tokens, chat template included (default: 4096)")
    add("--samples", type=int_at_least(1), default=20, help="samples per task and length (default: %(default)s)")
    add("--mode", choices=("question", "agnostic", "both"), default="question",
        help="question: context and question compressed together; agnostic: the context compressed alone, "
        "then the question answered from it; both (default: %(default)s)")
    add("--out", default="results", help="results folder; finished runs in it are skipped (default: %(default)s)")
    add("--seed", type=int_at_least(0), default=0, help="seed of the generated samples (default: %(default)s)")
    add("--max-new-tokens", type=int_at_least(1), help="tokens generated per answer (default: each task's own)")
    add("--haystack", help="a text file whose sentences replace the noise haystack")
    add("--no-full", action="store_true", help="do not run the full-cache reference")
    placement_args(parser)


def needs(args: argparse.Namespace) -> list[Need]:
    """The model's loader, the report printed at the end, accelerate's process split, and the Hub's datasets for
    `ruler:` / `longbench:` tasks."""
    hub = any(task.partition(":")[0] in ("ruler", "longbench") for task in args.tasks)
    return [*model_needs(args.model), PANDAS, ("accelerate", "eval", "to split a sweep over processes"),
            *([("datasets", "eval", "for Hub tasks")] if hub else [])]


def run(args: argparse.Namespace) -> int:
    from ..evaluation import EvalConfig, format_report, load_and_evaluate
    from ..evaluation.runner import check_model_name
    from ..models import MODELS

    try:
        config = EvalConfig(
            model=args.model, tasks=args.tasks, presses=args.presses, ratios=args.ratios, budgets=args.budgets,
            lengths=args.lengths, samples=args.samples, mode=args.mode, out=args.out, seed=args.seed,
            max_new_tokens=args.max_new_tokens, haystack=args.haystack, full=not args.no_full,
        )
        check_model_name(args.model)
        if args.haystack:
            from ..evaluation.tasks import read_haystack

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
