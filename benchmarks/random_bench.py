"""`sparsekv bench` (and its `--memory-budget` capacity search) on a model of a real shape with random weights.

Speed and memory do not depend on the weights' values; a GPU machine without the Hub cannot download an 8B
model, and building one from its config on the GPU takes seconds. Any tokenizer folder with a chat template
makes the prompts (only their length matters here).

    PYTHONPATH=. python benchmarks/random_bench.py --shape llama-3.1-8b --tokenizer TOKENIZER_DIR --device cuda \\
        --lengths 32768 --presses snapkv,streamingllm,chunkkv,h2o,chess,sentencekv --max-new-tokens 32
    PYTHONPATH=. python benchmarks/random_bench.py ... --memory-budget 24 --max-batch 64   # capacity instead
"""

from __future__ import annotations

import argparse

import torch
from random_models import SHAPES, random_model
from transformers import AutoTokenizer

from sparsekv.bench import format_capacity, format_rows, run_bench, run_capacity
from sparsekv.environment import environment
from sparsekv.models import DTYPES, placement
from sparsekv.presses.registry import split_specs


@torch.no_grad()
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--shape", choices=SHAPES, required=True)
    add("--tokenizer", metavar="DIR", required=True, help="tokenizer folder (any, with a chat template)")
    add("--device", default="auto", help="auto (CUDA when available), cpu, cuda (default: auto)")
    add("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on a GPU, float32 on a CPU")
    add("--attn-implementation", choices=("sdpa", "eager", "flash_attention_2"), default="sdpa")
    add("--lengths", default="32768", help="prompt lengths in tokens, comma-separated (default: %(default)s)")
    add("--presses", default="snapkv,streamingllm,chunkkv,h2o,chess,sentencekv", help="(default: %(default)s)")
    add("--ratio", type=float, default=0.1, help="fraction of the prompt's KV kept (default: %(default)s)")
    add("--batch-sizes", default="1", help="comma-separated (default: %(default)s)")
    add("--max-new-tokens", type=int, default=32, help="(default: %(default)s)")
    add("--repeats", type=int, default=1, help="(default: %(default)s)")
    add("--memory-budget", type=float, metavar="GB", help="instead of timing: the largest batch each fits")
    add("--max-batch", type=int, default=64, help="largest batch --memory-budget tries (default: %(default)s)")
    add("--json", metavar="FILE.json")
    add("--plot", metavar="FILE.png")
    parser.add_argument("--cudnn-sdpa", action="store_true",
                        help="let sdpa pick cuDNN attention (off by default: torch 2.11 rebuilds its plan for "
                        "every new KV length, ~1.2 ms of host time per layer and step; docs/gpu.md)")
    args = parser.parse_args(argv)
    if not args.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        device, dtype = placement(args.device, args.dtype)
        lengths = [int(n) for n in args.lengths.split(",")]
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError as err:
        parser.error(str(err))
    model = random_model(args.shape, device, dtype, args.attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    env = environment(model.device)
    title = (f"{args.shape} (random weights), {env['device_name']}, {str(dtype).removeprefix('torch.')}, "
             f"{args.attn_implementation}, {args.max_new_tokens} new tokens")
    print(title)
    presses = split_specs(args.presses)
    try:
        if args.memory_budget is not None:
            rows = run_capacity(model, tokenizer, lengths, presses, [args.ratio], None, args.memory_budget,
                                args.max_batch, args.max_new_tokens)
            print(format_capacity(rows, args.memory_budget))
            return
        rows = run_bench(model, tokenizer, lengths, presses, [args.ratio], None, args.max_new_tokens, args.repeats,
                         args.plot, args.json, title, batches)
    except ValueError as err:
        parser.error(str(err))
    print(format_rows(rows))


if __name__ == "__main__":
    main()
