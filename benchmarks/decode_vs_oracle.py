"""Decode step latency of presses against the oracle, with the prefill taken out of the comparison.

`sparsekv bench` times whole generations; on a shared CPU its decode / oracle ratio moves by 10-20% between
runs, more than a press's own per-step work. Here each press prefills the prompt once; every repeat decodes
`--steps` greedy steps from a copy of that cache, right after which the oracle (the full cache on the prompt's
last `ratio * length` tokens) decodes as many from a copy of its own. The table gives the median step of each
configuration and its ratio to the oracle's median.

    PYTHONPATH=. python benchmarks/decode_vs_oracle.py --presses chunkkv,chunkkv:reuse_layers=1,snapkv
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from tqdm.auto import tqdm

from sparsekv.evaluation.presses import make_press
from sparsekv.models import load_model
from sparsekv.niah import build_needle_prompt
from sparsekv.table import format_table


def median_step_ms(model, cache, token: torch.Tensor, steps: int) -> float:
    """Median wall time (ms) of `steps` greedy one-token forwards from `cache` (modified in place)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@torch.no_grad()
def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=8000, help="prompt tokens (default: 8000)")
    parser.add_argument("--presses", default="chunkkv,chunkkv:reuse_layers=1,snapkv",
                        help="comma-separated, with options as in `sparsekv bench` (default: %(default)s)")
    parser.add_argument("--ratio", type=float, default=0.1, help="fraction of the prompt's KV kept (default: 0.1)")
    parser.add_argument("--steps", type=int, default=40, help="decoding steps per repeat (default: 40)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (default: 5)")
    args = parser.parse_args()
    if not 0 < args.ratio <= 1:
        parser.error(f"--ratio: a fraction in (0, 1]; got {args.ratio}.")
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats: at least 1.")

    model, tokenizer = load_model(args.model)
    source, _ = build_needle_prompt(tokenizer, int(1.04 * args.length) + 16)
    ids = source[:, -args.length:]
    specs = args.presses.split(",")
    prefilled = {}
    for spec in tqdm(specs, desc="prefill"):
        press = make_press(spec, ratio=args.ratio, tokenizer=tokenizer)
        with press(model):
            out = model(ids, use_cache=True)
        prefilled[spec] = press, out.cache, out.logits[:, -1:].argmax(-1)
    out = model(ids[:, -round(args.ratio * args.length):], use_cache=True)
    oracle = out.cache, out.logits[:, -1:].argmax(-1)

    steps = {name: [] for name in [*specs, "oracle"]}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for spec, (press, cache, token) in prefilled.items():
            with press(model):
                steps[spec].append(median_step_ms(model, copy.deepcopy(cache), token, args.steps))
            steps["oracle"].append(median_step_ms(model, copy.deepcopy(oracle[0]), oracle[1], args.steps))
    reference = statistics.median(steps["oracle"])
    rows = [{"config": name, "ms": statistics.median(v), "ratio": statistics.median(v) / reference,
             "spread": f"{min(v):.1f}-{max(v):.1f}"} for name, v in steps.items()]
    print(f"{args.model}, {args.length}-token prompt, ratio {args.ratio}, {args.repeats} x {args.steps} steps")
    print(format_table(rows, [("config", "config", ""), ("decode ms/step", "ms", ".2f"),
                              ("decode / oracle", "ratio", ".3f"), ("repeats' range", "spread", "")]))


if __name__ == "__main__":
    main()
