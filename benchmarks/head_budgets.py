"""Head-wise and layer-wise budgets against the uniform press they build on: the KV a cache holds after the
prompt, how much of it is real tokens (the rest: a lane's free slots, or filler slots of a padded table), and an
eager decoding step's time.

    python -m benchmarks.head_budgets --length 4096 --ratios 0.1,0.25
    python -m benchmarks.head_budgets --shape llama-3.1-8b --tokenizer TOKENIZER_DIR --device cuda --length 32768
"""

from __future__ import annotations

import argparse
import statistics

import torch

from sparsekv.evaluation.presses import make_press
from sparsekv.presses.registry import split_specs
from sparsekv.table import format_table

from .decode_vs_oracle import needle_prompt, step_seconds
from .random_models import load_from_arguments, model_arguments, model_placement


def measure(model, ids: torch.Tensor, press, steps: int) -> dict:
    """The cache after the prompt (KV bytes held, real tokens over slots) and the median of `steps` decoding
    steps' wall times after one warm-up step."""
    with press(model), torch.no_grad():
        cache = press.make_cache(model)
        token = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        stats = cache.stats()  # (per layer: slots held per head, its lanes' too, and the real tokens among them)
        real, slots, held = sum(stats.attended_tokens), sum(stats.resident_tokens), stats.kv_bytes
        times = []
        for _ in range(steps + 1):
            seconds, token = step_seconds(model, cache, token)
            times.append(seconds)
    return {"kv_mb": held / 2**20, "fill": real / slots, "step_ms": 1e3 * statistics.median(times[1:])}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    model_arguments(parser)
    add("--length", type=int, default=4096, help="prompt tokens (default: %(default)s)")
    add("--ratios", default="0.1,0.25", help="fractions of the prompt's KV kept (default: %(default)s)")
    add("--presses", default="snapkv,adakv,pyramidkv,adakv:press=pyramidkv",
        help="(default: %(default)s; the first is the reference of the ratios)")
    add("--steps", type=int, default=16, help="decoding steps timed (default: %(default)s)")
    args = parser.parse_args(argv)
    model, tokenizer, name = load_from_arguments(args, *model_placement(args))
    ids = needle_prompt(tokenizer, args.length).to(model.device)
    specs = split_specs(args.presses)
    rows = []
    for ratio in (float(r) for r in args.ratios.split(",")):
        reference = None
        for spec in specs:
            result = measure(model, ids, make_press(spec, ratio=ratio, tokenizer=tokenizer), args.steps)
            reference = reference or result
            rows.append({"press": spec, "ratio": ratio, **result, "kv_ratio": result["kv_mb"] / reference["kv_mb"],
                         "step_ratio": result["step_ms"] / reference["step_ms"]})
    print(f"\n{name}, {ids.shape[1]}-token prompt, eager steps (median of {args.steps}); against {specs[0]}")
    print(format_table(rows, [("press", "press", ""), ("ratio", "ratio", "g"), ("KV held MiB", "kv_mb", ".1f"),
                              ("/ first", "kv_ratio", ".2f"), ("real / slots", "fill", ".2f"),
                              ("step ms", "step_ms", ".2f"), ("step / first", "step_ratio", ".2f")]))


if __name__ == "__main__":
    main()
