"""Head-wise and layer-wise budgets against the uniform press they build on: the KV a cache holds after the
prompt, how much of it is real tokens (the rest: a lane's free slots, or filler slots of a padded table), and an
eager decoding step's time, the presses' steps interleaved.

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


def prefill(model, ids: torch.Tensor, press) -> dict:
    """The cache after the prompt under `press`: its KV bytes held and its real tokens over its slots."""
    with press(model), torch.no_grad():
        cache = press.make_cache(model)
        token = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    stats = cache.stats()  # (per layer: slots held per head, its lanes' too, and the real tokens among them)
    return {"press": press, "cache": cache, "token": token, "kv_mb": stats.kv_bytes / 2**20,
            "fill": sum(stats.attended_tokens) / sum(stats.resident_tokens), "times": []}


def interleaved_steps(model, runs: list[dict], steps: int) -> None:
    """`steps` decoding steps of each run's cache, in rounds of one step each (after a warm-up round), so that
    a CPU's drift between configurations falls on all of them alike; each run's step times in `times`."""
    for round_ in range(steps + 1):
        for run in runs:
            with run["press"](model), torch.no_grad():
                seconds, run["token"] = step_seconds(model, run["cache"], run["token"])
            if round_:
                run["times"].append(seconds)


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
        runs = [prefill(model, ids, make_press(spec, ratio=ratio, tokenizer=tokenizer)) for spec in specs]
        interleaved_steps(model, runs, args.steps)
        reference = runs[0]
        for spec, run in zip(specs, runs):  # a step's ratio to the first press's in its round, the median
            ratios = [t / r for t, r in zip(run["times"], reference["times"])]
            rows.append({"press": spec, "ratio": ratio, "kv_mb": run["kv_mb"], "fill": run["fill"],
                         "kv_ratio": run["kv_mb"] / reference["kv_mb"],
                         "step_ms": 1e3 * statistics.median(run["times"]), "step_ratio": statistics.median(ratios)})
        del runs
    print(f"\n{name}, {ids.shape[1]}-token prompt, eager steps (median of {args.steps}, in rounds of one step a "
          f"press; step / first: the median of a step's ratio to the first press's in its round); against {specs[0]}")
    print(format_table(rows, [("press", "press", ""), ("ratio", "ratio", "g"), ("KV held MiB", "kv_mb", ".1f"),
                              ("/ first", "kv_ratio", ".2f"), ("real / slots", "fill", ".2f"),
                              ("step ms", "step_ms", ".2f"), ("step / first", "step_ratio", ".2f")]))


if __name__ == "__main__":
    main()
