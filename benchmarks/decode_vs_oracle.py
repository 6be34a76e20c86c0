"""Decode step latency of presses against the oracle, with the prefill taken out of the comparison.

`sparsekv bench` times whole generations; on a shared CPU its decode / oracle ratio moves by 10-20% between
runs, more than a press's own per-step work. Here each press prefills the prompt once; every repeat decodes
`--steps` greedy steps from a copy of that cache, each step followed by one of the oracle (the full cache on the
prompt's last `ratio * length` tokens, from a copy of its own), so that the two share the machine's load of
the moment; the full cache decodes as many after them. The table gives the median step of each configuration
and a press's ratio to the oracle: the median over its (press step / oracle step) pairs, with their quartiles.
`--batch 1,4` decodes 1, then 4 copies of the prompt at once (every row its own budget and state; a step reads
the KV of every row), and `--plot` draws tokens/s against batch size.

    python -m benchmarks.decode_vs_oracle --presses chunkkv,chunkkv:reuse_layers=1,snapkv
    python -m benchmarks.decode_vs_oracle --length 4096 --batch 1,4 --presses snapkv,h2o --plot batch.png

On a GPU, with a model of a real shape and random weights (`random_models.py`; any tokenizer folder), the
decoding steps' host synchronisations counted per press (`--count-syncs`):

    python -m benchmarks.decode_vs_oracle --shape llama-3.1-8b --tokenizer TOKENIZER_DIR \
        --device cuda --length 32768 --count-syncs --presses snapkv,streamingllm
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
import traceback
import warnings
from collections import Counter

import torch
from tqdm.auto import tqdm

from sparsekv.bench import plot_throughput
from sparsekv.environment import environment
from sparsekv.evaluation.presses import make_press
from sparsekv.niah import build_needle_prompt
from sparsekv.presses.registry import split_specs
from sparsekv.table import format_table

from .random_models import load_from_arguments, model_arguments, model_placement


def needle_prompt(tokenizer, length: int) -> torch.Tensor:
    """`(1, length)` ids: the last `length` tokens of a needle prompt built a little longer (its filler is cut
    at sentence ends, so a prompt built to `length` can fall a few tokens short)."""
    source, _ = build_needle_prompt(tokenizer, int(1.04 * length) + 16)
    return source[:, -length:]


def step_seconds(model, cache, token: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Wall time of one greedy one-token forward from `cache` (modified in place), and the next token."""
    start = time.perf_counter()
    token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    if token.is_cuda:
        torch.cuda.synchronize(token.device)  # the step's kernels, not only their launches
    return time.perf_counter() - start, token


def syncs_per_step(model, cache, token: torch.Tensor, press=None, steps: int = 4) -> tuple[list[int], Counter]:
    """Host-device synchronisations of each of `steps` one-token forwards from `cache` (CUDA only): ops torch's
    sync debug mode warns about (`.item()`, `bool(tensor)`, `nonzero`, copies from pageable host memory, ...),
    and where they were issued: a Counter of "file:line function" of the innermost frame in sparsekv or
    transformers (the first step apart from the others: a step after the prompt can do one-time work)."""
    per_step, sites, step = [0] * steps, Counter(), 0

    def record(message, category, filename, lineno, file=None, line=None):
        nonlocal step
        if "synchroniz" not in str(message):
            return
        per_step[step] += 1
        stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        ours = [f for f in stack if "/sparsekv/" in f.filename]
        theirs = [f for f in stack if "/transformers/" in f.filename]
        where = max(ours[-1:] + theirs[-1:], key=stack.index, default=stack[-1])
        site = f"{'/'.join(where.filename.split('/')[-2:])}:{where.lineno} {where.name}"
        if ours and where is not ours[-1]:  # transformers' code, run from a sparsekv frame
            site += f" (from {'/'.join(ours[-1].filename.split('/')[-2:])}:{ours[-1].lineno})"
        sites[site] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for step in range(steps):
                with press(model) if press is not None else contextlib.nullcontext():
                    token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return per_step, sites


def loaded_tokens(cache) -> int:
    """Tokens a press copied into its working sets so far, every layer's and row's (`stats().counts`)."""
    return cache.stats().counts.get("loaded_tokens", 0)


def kv_bytes_per_token(cache) -> int:
    """Bytes of one token's key and value in one KV head (what a press's `loaded_tokens` counts: one per layer,
    row and head)."""
    layer = cache.compressed_layers()[0]
    keys = layer.store_keys if getattr(layer, "store_keys", None) is not None else layer.keys
    return (keys.shape[-1] + layer.values.shape[-1]) * keys.element_size()


def measure(model, tokenizer, ids, specs, ratio, steps, repeats, full: bool = True, count_syncs: bool = False
            ) -> list[dict]:
    """Median step (ms) of every press in `specs`, the oracle and (`full`) the full cache on the prompts `ids`.

    Each press step is followed by an oracle step (from a copy of the oracle's cache), so the two see the same
    machine load; a press's ratio is the median over these pairs of press step / oracle step. `count_syncs`
    (CUDA): each configuration's host synchronisations per step, from a copy of its prefilled cache.
    """
    prefilled = {}
    for spec in tqdm(specs, desc=f"prefill, batch {ids.shape[0]}"):
        press = make_press(spec, ratio=ratio, tokenizer=tokenizer)
        with press(model):
            out = model(ids, use_cache=True, logits_to_keep=1)  # as generate: not the whole prompt's logits
        prefilled[spec] = press, out.cache, out.logits[:, -1:].argmax(-1)
    references = {}
    for name, context in (("oracle", ids[:, -round(ratio * ids.shape[1]):]), ("full", ids))[: 2 if full else 1]:
        out = model(context, use_cache=True, logits_to_keep=1)
        references[name] = out.cache, out.logits[:, -1:].argmax(-1)

    times = {name: [] for name in [*specs, *references]}
    pairs = {spec: [] for spec in specs}
    moved = {spec: [] for spec in specs}  # bytes of KV a press copied into its working set, per step
    for _ in tqdm(range(repeats), desc="repeats"):
        for spec, (press, cache, token) in prefilled.items():
            cache = copy.deepcopy(cache)
            oracle, oracle_token = copy.deepcopy(references["oracle"][0]), references["oracle"][1]
            loaded = loaded_tokens(cache)
            for _ in range(steps):
                with press(model):
                    seconds, token = step_seconds(model, cache, token)
                reference, oracle_token = step_seconds(model, oracle, oracle_token)
                times[spec].append(1000 * seconds)
                times["oracle"].append(1000 * reference)
                pairs[spec].append(seconds / reference)
            moved[spec].append((loaded_tokens(cache) - loaded) * kv_bytes_per_token(cache) / steps)
        if full:
            cache, token = copy.deepcopy(references["full"][0]), references["full"][1]
            for _ in range(steps):
                seconds, token = step_seconds(model, cache, token)
                times["full"].append(1000 * seconds)
    syncs = {}
    if count_syncs:
        for name, (press, cache, token) in {**prefilled, **{k: (None, *v) for k, v in references.items()}}.items():
            per_step, sites = syncs_per_step(model, copy.deepcopy(cache), token, press)
            syncs[name] = {"per_step": per_step, "sites": dict(sites.most_common())}
    oracle = statistics.median(times["oracle"])
    full = statistics.median(times["full"]) if full else None
    batch = ids.shape[0]
    rows = []
    for name, v in times.items():
        ms = statistics.median(v)
        ratios = pairs.get(name)
        quartiles = statistics.quantiles(ratios, n=4) if ratios else None
        rows.append({"config": name, "batch": batch, "length": ids.shape[1], "ms": ms,
                     "ratio": statistics.median(ratios) if ratios else ms / oracle,
                     "speedup": full / ms if full else None, "tok_s": 1000 * batch / ms,
                     "syncs": syncs[name]["per_step"] if name in syncs else None,
                     "sync_sites": syncs[name]["sites"] if name in syncs else None,
                     "spread": f"{quartiles[0]:.3f}-{quartiles[2]:.3f}" if quartiles else "",
                     "loaded_kb": statistics.mean(moved[name]) / 1024 if moved.get(name) else None})
    return rows


@torch.no_grad()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_arguments(parser)
    parser.add_argument("--no-full", action="store_true", help="skip the full cache (large batches: it and its "
                        "copy may not fit)")
    parser.add_argument("--count-syncs", action="store_true", help="CUDA: host synchronisations per decoding step")
    parser.add_argument("--json", metavar="FILE.json", help="write the rows and the environment")
    parser.add_argument("--length", type=int, default=8000, help="prompt tokens (default: 8000)")
    parser.add_argument("--presses", default="chunkkv,chunkkv:reuse_layers=1,snapkv",
                        help="comma-separated, with options as in `sparsekv bench` (default: %(default)s)")
    parser.add_argument("--ratio", type=float, default=0.1, help="fraction of the prompt's KV kept (default: 0.1)")
    parser.add_argument("--steps", type=int, default=40, help="decoding steps per repeat (default: 40)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (default: 5)")
    parser.add_argument("--batch", default="1", help="copies of the prompt decoded together, comma-separated "
                                                     "batch sizes (default: 1)")
    parser.add_argument("--plot", metavar="FILE.png", help="write tokens/s against batch size (several --batch)")
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        parser.error(f"--batch: comma-separated integers; got {args.batch!r}.")
    if not 0 < args.ratio <= 1:
        parser.error(f"--ratio: a fraction in (0, 1]; got {args.ratio}.")
    if args.steps < 1 or args.repeats < 1 or min(batches) < 1:
        parser.error("--steps, --repeats and --batch: at least 1.")
    device, dtype = model_placement(args)
    if args.count_syncs and (args.device_map or torch.device(device).type != "cuda"):
        parser.error("--count-syncs: one CUDA device (--device cuda) only (torch's sync debug mode).")
    model, tokenizer, name = load_from_arguments(args, device, dtype)
    ids = needle_prompt(tokenizer, args.length).to(model.device)
    rows = []
    for batch in batches:
        rows += measure(model, tokenizer, ids.expand(batch, -1), split_specs(args.presses), args.ratio, args.steps,
                        args.repeats, full=not args.no_full, count_syncs=args.count_syncs)
    env = environment(model.device)
    print(f"{name}, {env['device_name']}, {str(dtype).removeprefix('torch.')}, {args.attn_implementation}, "
          f"{args.length}-token prompt, ratio {args.ratio}, {args.repeats} x {args.steps} steps paired with the "
          "oracle's; tok/s over the batch")
    columns = [("config", "config", ""), ("batch", "batch", ""), ("decode ms/step", "ms", ".2f"),
               ("decode / oracle", "ratio", ".3f"), ("full / decode", "speedup", ".2f"), ("tok/s", "tok_s", ".1f"),
               ("ratio quartiles", "spread", "")]
    if any(row["loaded_kb"] for row in rows):
        columns.append(("KV loaded kB/step", "loaded_kb", ".1f"))
    if args.count_syncs:
        for row in rows:
            row["syncs_shown"] = " ".join(map(str, row["syncs"]))
        columns.append(("host syncs, steps 1 2 ...", "syncs_shown", ""))
    print(format_table(rows, columns))
    for row in rows if args.count_syncs else []:
        for site, n in (row["sync_sites"] or {}).items():
            print(f"  {row['config']} b{row['batch']}: {n} x {site}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, "length": args.length, "ratio": args.ratio, "steps": args.steps,
                       "repeats": args.repeats, "dtype": str(dtype), "attn_implementation": args.attn_implementation,
                       "environment": env, "rows": rows}, f, indent=1)
    if args.plot:
        print("plot:", plot_throughput(rows, args.plot, f"{args.model}, {args.length}-token prompts, ratio "
                                                        f"{args.ratio}: decoding throughput"))


if __name__ == "__main__":
    main()
