"""`sparsekv demo`: one needle-in-a-haystack prompt, the full cache against each press."""

from __future__ import annotations

import argparse

from .args import MODEL_HELP, Need, fraction, int_at_least, model_needs, placement, placement_args

HELP = "needle-in-a-haystack demo: full cache vs each press"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2-135m", help=MODEL_HELP)
    add("--tokens", type=int_at_least(64), default=2000, help="prompt length in tokens, >= 64 (default: %(default)s)")
    add("--ratio", type=fraction(zero_allowed=False), default=0.1,
        help="fraction of the prompt's KV kept, in (0, 1] (default: %(default)s)")
    add("--max-new-tokens", type=int_at_least(1), default=16, help="tokens generated (default: %(default)s)")
    add("--depth", type=fraction(zero_allowed=True), default=0.5, help="needle depth in [0, 1] (default: %(default)s)")
    placement_args(parser)


def needs(args: argparse.Namespace) -> list[Need]:
    return model_needs(args.model)


def run(args: argparse.Namespace) -> int:
    from ..demo import run_demo
    from ..models import MODELS

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
