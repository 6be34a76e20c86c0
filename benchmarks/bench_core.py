"""Core benchmark: what each press costs at prefill and saves at decoding, on one long needle prompt.

Compared on a `--length`-token needle prompt: the full cache, each press at `--ratio`, and the "oracle", the
full cache on a prompt of `ratio * length` tokens (the fastest decoding a cache of that size can give).
Per-token decode latency comes from a logits processor that stamps the time at every generation step
(`sparsekv.demo.StepClock`): the median of the step-to-step deltas. Prefill is the time to the first stamp.

    PYTHONPATH=. python benchmarks/bench_core.py --length 8000 --repeats 3 --plot decode.png
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
from tqdm.auto import tqdm

from sparsekv import H2OPress, SnapKVPress, StreamingLLMPress
from sparsekv.demo import cache_footprint, format_table, timed_generate
from sparsekv.models import load_model
from sparsekv.niah import build_needle_prompt, score_answer


def measure(model, tokenizer, input_ids, answer, press, max_new_tokens: int) -> dict:
    """One greedy generation of exactly `max_new_tokens` tokens: prefill s, median decode ms/token, KV bytes."""
    with press(model) if press is not None else contextlib.nullcontext():
        # min_new_tokens: the same number of steps for every configuration
        out, _, stamps = timed_generate(model, input_ids, max_new_tokens, min_new_tokens=max_new_tokens)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    text = tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True)
    return {
        "prefill": stamps[0],
        "decode": 1000 * statistics.median(steps) if steps else float("nan"),
        "kv_bytes": cache_footprint(out.past_key_values)[1],
        "correct": score_answer(text, answer),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="model alias or path (default: %(default)s)")
    parser.add_argument("--length", type=int, default=8000, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--ratio", type=float, default=0.1, help="fraction of the KV kept (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per configuration (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated (default: %(default)s)")
    parser.add_argument("--plot", metavar="FILE.png", help="write a bar chart of decode ms/token")
    args = parser.parse_args(argv)
    if not 0 < args.ratio <= 1 or args.length < 64 or args.repeats < 1 or args.max_new_tokens < 2:
        parser.error("need 0 < --ratio <= 1, --length >= 64, --repeats >= 1 and --max-new-tokens >= 2")

    model, tokenizer = load_model(args.model)
    context = model.config.max_position_embeddings
    if args.length + args.max_new_tokens > context:
        parser.error(f"--length + --max-new-tokens exceeds the model's context ({context} tokens)")
    long_ids, long_answer = build_needle_prompt(tokenizer, args.length)
    short_ids, short_answer = build_needle_prompt(tokenizer, max(64, round(args.ratio * args.length)))
    full, oracle = f"full ({long_ids.shape[1]} tok)", f"oracle ({short_ids.shape[1]} tok)"
    configs = {  # name -> (prompt, answer, press)
        full: (long_ids, long_answer, None),
        **{
            f"{cls.__name__.removesuffix('Press')} @ {args.ratio}": (long_ids, long_answer, cls(ratio=args.ratio))
            for cls in (SnapKVPress, H2OPress, StreamingLLMPress)
        },
        oracle: (short_ids, short_answer, None),
    }
    print(f"{args.model}: {torch.get_num_threads()} threads, {args.max_new_tokens} new tokens, {args.repeats} repeats")

    warm_ids, warm_answer = build_needle_prompt(tokenizer, min(args.length, 1000))
    for _, _, press in tqdm(configs.values(), desc="warm-up"):  # every code path once, on a short prompt
        measure(model, tokenizer, warm_ids, warm_answer, press, 4)
    runs = {name: [] for name in configs}
    with tqdm(total=args.repeats * len(configs), desc="measuring") as bar:
        for _ in range(args.repeats):  # interleaved, so that drift in machine load hits every configuration
            for name, (ids, answer, press) in configs.items():
                runs[name].append(measure(model, tokenizer, ids, answer, press, args.max_new_tokens))
                bar.update()

    keys = ("prefill", "decode", "kv_bytes")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    rows = [
        {
            "press": name,
            "needle": f"{sum(r['correct'] for r in runs[name])}/{len(runs[name])}",
            "prefill": m["prefill"],
            "prefill_x": m["prefill"] / med[full]["prefill"],
            "decode": m["decode"],
            "decode_x": m["decode"] / med[oracle]["decode"],
            "kv_mb": m["kv_bytes"] / 2**20,
            "kv_x": m["kv_bytes"] / med[full]["kv_bytes"],
        }
        for name, m in med.items()
    ]
    print(format_table(rows, [
        ("press", "press", ""), ("needle", "needle", ""),
        ("prefill s", "prefill", ".2f"), ("prefill / full", "prefill_x", ".2f"),
        ("decode ms/tok", "decode", ".1f"), ("decode / oracle", "decode_x", ".2f"),
        ("KV MB", "kv_mb", ".2f"), ("KV / full", "kv_x", ".3f"),
    ]))

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        presses = [name for name in configs if name not in (full, oracle)]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar(presses, [med[p]["decode"] for p in presses], color="tab:blue")
        ax.axhline(med[full]["decode"], color="tab:red", linestyle="--", label=full)
        ax.axhline(med[oracle]["decode"], color="tab:green", linestyle="--", label=oracle)
        ax.set_ylabel("decode ms / token (median)")
        ax.set_title(f"{args.model}, {long_ids.shape[1]}-token prompt, ratio {args.ratio}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return rows


if __name__ == "__main__":
    main()
