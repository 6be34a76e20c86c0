"""`sparsekv bench` (and its `--memory-budget` capacity search) on a model of a real shape with random weights.

Speed and memory do not depend on the weights' values; a GPU machine without the Hub cannot download an 8B
model, and building one from its config on the GPU takes seconds. Any tokenizer folder with a chat template
makes the prompts (only their length matters here).

    python -m benchmarks.random_bench --shape llama-3.1-8b --tokenizer TOKENIZER_DIR --device cuda \\
        --lengths 32768 --presses snapkv,streamingllm,chunkkv,h2o,chess,sentencekv --max-new-tokens 32
    python -m benchmarks.random_bench ... --memory-budget 24 --max-batch 64   # capacity instead
"""

from __future__ import annotations

import argparse

import torch

from sparsekv.bench import format_capacity, format_rows, run_bench, run_capacity
from sparsekv.environment import environment
from sparsekv.presses.registry import split_specs

from .random_models import load_from_arguments, model_arguments, model_placement


@torch.no_grad()
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    model_arguments(parser, shape_only=True)
    add("--lengths", default="32768", help="prompt lengths in tokens, comma-separated (default: %(default)s)")
    add("--presses", default="snapkv,streamingllm,chunkkv,h2o,chess,sentencekv", help="(default: %(default)s)")
    add("--ratio", type=float, default=0.1, help="fraction of the prompt's KV kept (default: %(default)s)")
    add("--batch-sizes", default="1", help="comma-separated (default: %(default)s)")
    add("--max-new-tokens", type=int, default=32, help="(default: %(default)s)")
    add("--repeats", type=int, default=1, help="(default: %(default)s)")
    add("--memory-budget", type=float, metavar="GB", help="instead of timing: the largest batch each fits")
    add("--max-batch", type=int, default=64, help="largest batch --memory-budget tries (default: %(default)s)")
    add("--exact-batch", action="store_true", help="with --memory-budget: bisect between the last batch that fit "
        "and the first that did not")
    add("--rows-apart", action="store_true", help="prefill each batch a row at a time and join the caches "
        "(sparsekv.prefill_rows; not CHESS)")
    add("--json", metavar="FILE.json")
    add("--plot", metavar="FILE.png")
    args = parser.parse_args(argv)
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError as err:
        parser.error(str(err))
    if args.exact_batch and args.memory_budget is None:  # as `sparsekv bench`: refused before the model is built
        parser.error("--exact-batch: only with --memory-budget (it refines the batch that search finds).")
    device, dtype = model_placement(args)
    model, tokenizer, name = load_from_arguments(args, device, dtype)
    env = environment(model.device)
    title = (f"{name}, {env['device_name']}, {str(dtype).removeprefix('torch.')}, "
             f"{args.attn_implementation}, {args.max_new_tokens} new tokens")
    print(title)
    presses = split_specs(args.presses)
    try:
        if args.memory_budget is not None:
            rows = run_capacity(model, tokenizer, lengths, presses, [args.ratio], None, args.memory_budget,
                                args.max_batch, args.max_new_tokens, args.rows_apart, args.exact_batch)
            print(format_capacity(rows, args.memory_budget))
            return
        rows = run_bench(model, tokenizer, lengths, presses, [args.ratio], None, args.max_new_tokens, args.repeats,
                         args.plot, args.json, title, batches, rows_apart=args.rows_apart)
    except ValueError as err:
        parser.error(str(err))
    print(format_rows(rows))


if __name__ == "__main__":
    main()
