"""`sparsekv bench`: prefill and decode latency, memory and KV of presses against the full cache and the oracle
(the measuring itself: `sparsekv.bench`)."""

from __future__ import annotations

import argparse

from .args import (
    MATPLOTLIB,
    MODEL_HELP,
    PRESSES_HELP,
    Need,
    csv,
    fraction,
    int_at_least,
    model_needs,
    placement,
    placement_args,
    press_specs,
)

HELP = "prefill and decode latency, memory and KV: presses vs the full cache and the oracle"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2-135m", help=MODEL_HELP)
    add("--lengths", type=csv(int_at_least(1)), default=[8000], help="prompt lengths in tokens (default: 8000)")
    add("--presses", type=press_specs, default=["snapkv", "h2o", "streamingllm", "chunkkv"],
        help=f"{PRESSES_HELP} (default: snapkv,h2o,streamingllm,chunkkv; the full cache and each press's oracle "
        "are always measured)")
    kept = parser.add_mutually_exclusive_group()
    kept.add_argument("--ratios", type=csv(fraction(zero_allowed=False)),
                      help="fractions of the prompt's KV kept, each in (0, 1] (default: 0.1)")
    kept.add_argument("--budgets", type=csv(int_at_least(1)),
                      help="tokens of KV kept (CHESS: its read_budget, tokens a step reads), instead of --ratios")
    add("--max-new-tokens", type=int_at_least(2), default=64, help="tokens generated, exactly (default: %(default)s)")
    add("--batch-sizes", type=csv(int_at_least(1)), default=[1],
        help="prompts decoded together, comma-separated (default: 1); with several, --plot also draws tokens/s "
        "against batch size")
    add("--memory-budget", type=float, metavar="GB",
        help="instead of timing: the largest batch (1, 2, 4, ... up to --max-batch) each configuration fits in GB "
        "(weights + measured peak), and its tokens/s")
    add("--max-batch", type=int_at_least(1), default=64, help="largest batch tried by --memory-budget "
        "(default: %(default)s)")
    add("--exact-batch", action="store_true", help="with --memory-budget: bisect between the last batch that fit "
        "and the first that did not (about log2(batch) more runs), instead of reporting the last power of 2")
    add("--rows-apart", action="store_true",
        help="prefill each batch one row at a time and join the caches before decoding them together "
        "(sparsekv.prefill_rows): the prefill's peak is one row's; presses that cannot join (CHESS) are refused")
    add("--ragged", action="store_true",
        help="rows of different lengths in a batch: from --lengths down to half of it, left-padded")
    add("--repeats", type=int_at_least(1), default=3, help="timed runs per configuration (default: %(default)s)")
    add("--plot", metavar="FILE.png", help="write decode latency vs generated tokens, a line per configuration")
    add("--json", metavar="FILE.json", help="write the rows, with per-step latency curves")
    placement_args(parser)


def needs(args: argparse.Namespace) -> list[Need]:
    return [*model_needs(args.model), ("psutil", "eval", "to measure memory"), *([MATPLOTLIB] if args.plot else [])]


def run(args: argparse.Namespace) -> int:
    """Run `sparsekv bench` with parsed `args`; bad inputs exit through `args.parser.error`."""
    import torch

    from ..bench import check_inputs, format_capacity, format_rows, run_bench, run_capacity, sweep
    from ..evaluation.runner import check_model_name
    from ..models import MODELS, load_model

    ratios = args.ratios if args.ratios or args.budgets else [0.1]
    device, dtype = placement(args)
    try:
        spec = MODELS.get(args.model)
        check_model_name(args.model)
        check_inputs(args.lengths, args.presses, ratios, args.budgets, args.max_new_tokens, args.repeats,
                     spec.context_length if spec else None, args.plot, args.json)
        sweep(args.lengths, args.presses, ratios, args.budgets, args.batch_sizes, args.ragged)
        if args.memory_budget is not None and (args.memory_budget <= 0 or args.batch_sizes != [1] or args.ragged):
            raise ValueError("--memory-budget: a positive number of GB, without --batch-sizes or --ragged (it "
                             "searches the batch size itself).")
        if args.exact_batch and args.memory_budget is None:
            raise ValueError("--exact-batch: only with --memory-budget (it refines the batch that search finds).")
        model, tokenizer = load_model(args.model, dtype=dtype, attn_implementation=args.attn_implementation,
                                      device_map=device)
        if args.memory_budget is not None:
            print(f"{args.model}, {device}, {torch.get_num_threads()} threads, {args.max_new_tokens} new tokens")
            rows = run_capacity(model, tokenizer, args.lengths, args.presses, ratios, args.budgets,
                                args.memory_budget, args.max_batch, args.max_new_tokens, args.rows_apart,
                                args.exact_batch)
            print(format_capacity(rows, args.memory_budget))
            return 0
        title = f"{args.model}, {device}, {torch.get_num_threads()} threads, median of {args.repeats}"
        print(title)
        rows = run_bench(model, tokenizer, args.lengths, args.presses, ratios, args.budgets, args.max_new_tokens,
                         args.repeats, args.plot, args.json, title, args.batch_sizes, args.ragged, args.rows_apart)
    except ValueError as err:
        args.parser.error(str(err))
    print(format_rows(rows))
    for path in (args.plot, args.json):
        if path:
            print(f"wrote {path}")
    return 0
