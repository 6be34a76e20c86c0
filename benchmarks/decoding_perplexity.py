"""Long generations held at a budget: teacher-forced perplexity of real prose continued far past a short prompt,
each token fed as a decoding step, with the cache held at a budget (StreamingLLM's protocol: log-perplexity
against position), beside the full cache.

The text is Python's reference manual (`pydoc_data.topics`, every topic in order), read by the model's own
tokenizer: `--prompt` tokens as the prompt, then `--tokens` tokens, one forward each, scoring each token's
probability given the cache before it.

    python -m benchmarks.decoding_perplexity --model smollm2-135m --budgets 256,512,1024 --tokens 8192 \\
        --presses streamingllm,h2o,decoding:press=snapkv --plot docs/decoding_ppl_smollm2.png

A press spec is made with each `--budgets` value (`budget=`); `decoding:press=snapkv` is `DecodingPress` over
SnapKV (its `interval`, default 64, in the spec: `decoding:press=snapkv,interval=32`). The JSON lines of
`--out` keep each configuration's per-token losses, and a configuration already there is not run again.

kvpress's `DecodingPress(SnapKVPress(), compression_interval, target_size)` on the same tokens, in kvpress's own
environment (it pins transformers < 5.3): the sparsekv run writes its tokens and model file beside `--out`
(`.ids.json`), which `--kvpress` reads; its rows join `--out`, and a sparsekv run then tables and plots them with
its own (kvpress's dashed):

    python -m benchmarks.decoding_perplexity --kvpress --budgets 256,512,1024 --interval 64 --window 32 \\
        --out decoding_ppl.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm


def reference_text() -> str:
    """Python's reference manual, every topic in order of its name: real prose, in every Python."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


@torch.no_grad()
def token_losses(model, ids: torch.Tensor, prompt: int, press=None, label: str = "") -> tuple[list[float], int]:
    """Negative log-likelihood (nats) of each token after the first `prompt` of `ids` `(1, n)`, each fed as one
    decoding step over the cache the tokens before it left (the full cache without `press`), and the most
    tokens a layer held."""
    import inspect

    losses, held = [], 0
    # (transformers 5.24 takes the cache as `cache`; kvpress's 5.2, as `past_key_values`)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run(cache):
        nonlocal held
        logits = model(ids[:, :prompt], **{name: cache}, use_cache=True).logits[:, -1]
        for i in tqdm(range(prompt, ids.shape[1]), desc=label, leave=False):
            losses.append(float(torch.nn.functional.cross_entropy(logits.float(), ids[:, i])))
            if i + 1 == ids.shape[1]:
                break
            logits = model(ids[:, i:i + 1], **{name: cache}, use_cache=True).logits[:, -1]
            held = max(held, cache_tokens(cache))  # (every step: a press that cuts every k steps peaks before)
        held = max(held, cache_tokens(cache))

    from transformers import DynamicCache

    if press is None:
        run(DynamicCache(config=model.config))
    elif hasattr(press, "make_cache"):  # sparsekv's
        with press(model):
            run(press.make_cache(model))
    else:  # kvpress's, over transformers' own cache
        with press(model):
            run(DynamicCache(config=model.config))
    return losses, held


def cache_tokens(cache) -> int:
    """The most real tokens a row's KV head holds in any layer (`KVLayer.tokens_held`: lanes too); every slot, for
    transformers' own cache."""
    held = [layer.tokens_held() for layer in getattr(cache, "layers", []) if hasattr(layer, "tokens_held")]
    return max(int(t.max()) for t in held) if held else cache.get_seq_length()


def perplexity(losses: list[float]) -> float:
    return math.exp(sum(losses) / len(losses)) if losses else float("nan")


def plot(runs: list[dict], path: str, title: str, bucket: int) -> None:
    """Perplexity of each `bucket` tokens against position, a line per configuration (the full cache black)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        losses = run["losses"]
        xs = [start + bucket for start in range(0, len(losses) - bucket + 1, bucket)]
        ys = [perplexity(losses[x - bucket:x]) for x in xs]
        full = run["config"] == "full cache"
        ax.plot(xs, ys, color="black" if full else None, linewidth=2 if full else 1, label=run["config"],
                linestyle="--" if run["config"].startswith("kvpress") else "-")
    ax.set_xlabel("tokens past the prompt")
    ax.set_ylabel(f"perplexity of each {bucket} tokens")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def kvpress_rows(args) -> None:
    """kvpress's `DecodingPress` over SnapKV at each budget, on the tokens a sparsekv run wrote (`.ids.json`)."""
    from kvpress import DecodingPress, SnapKVPress
    from transformers import AutoModelForCausalLM

    saved = json.loads(Path(args.out).with_suffix(".ids.json").read_text())
    path = Path(saved["model_file"])
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, args.dtype),
                                                 attn_implementation="sdpa").eval()
    ids = torch.tensor([saved["ids"]])
    done = {json.loads(line)["config"] for line in Path(args.out).read_text().splitlines()}
    for budget in [int(b) for b in args.budgets.split(",")]:
        config = f"kvpress DecodingPress(SnapKV window={args.window}) interval={args.interval} budget={budget}"
        if config in done:
            continue
        # (its SnapKV scores with the steps since the last compression, more than its window: 64 by default)
        press = DecodingPress(base_press=SnapKVPress(window_size=args.window), compression_interval=args.interval,
                              target_size=budget)
        losses, held = token_losses(model, ids, saved["prompt"], press, config)
        with Path(args.out).open("a") as f:
            f.write(json.dumps({"model": saved["model"], "prompt": saved["prompt"], "tokens": len(losses),
                                "config": config, "held": held, "losses": losses}) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="alias, .gguf file or folder (default: %(default)s)")
    add("--prompt", type=int, default=64, help="prompt tokens (default: %(default)s)")
    add("--tokens", type=int, default=8192, help="tokens scored past the prompt (default: %(default)s)")
    add("--budgets", default="256,512,1024", help="tokens each press holds (default: %(default)s)")
    add("--presses", default="streamingllm,h2o,decoding:press=snapkv", help="press specs (default: %(default)s)")
    add("--no-full", action="store_true", help="leave out the full cache")
    add("--dtype", default="float32", choices=("float32", "bfloat16"), help="(default: %(default)s)")
    add("--out", default="decoding_ppl.jsonl", help="per-token losses, one JSON line per configuration "
        "(resumed: a configuration there is not run again; default: %(default)s)")
    add("--plot", help="write the plot of perplexity against position here")
    add("--bucket", type=int, default=512, help="tokens per point of the plot (default: %(default)s)")
    add("--kvpress", action="store_true", help="run kvpress's DecodingPress over SnapKV instead, at each budget, on "
        "the tokens a sparsekv run wrote beside --out (kvpress's own environment)")
    add("--interval", type=int, default=64, help="with --kvpress: its compression_interval (default: %(default)s)")
    add("--window", type=int, default=32, help="with --kvpress: its SnapKV's window_size, under --interval (kvpress "
        "scores with the steps since its last compression; default: %(default)s, sparsekv's SnapKV's)")
    args = parser.parse_args(argv)
    if args.kvpress:
        return kvpress_rows(args)
    from sparsekv.models import fetch_model, load_model
    from sparsekv.presses.registry import make_press, split_specs
    from sparsekv.table import format_table

    if args.prompt < 1 or args.tokens < 1:
        parser.error("--prompt and --tokens: at least 1 token each")
    try:
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--budgets: integers, comma-separated; got {args.budgets!r}")
    model, tokenizer = load_model(args.model, getattr(torch, args.dtype), "sdpa")
    ids = tokenizer(reference_text(), return_tensors="pt").input_ids[:, :args.prompt + args.tokens]
    if ids.shape[1] < args.prompt + args.tokens:
        parser.error(f"--tokens: the text has {ids.shape[1] - args.prompt} tokens past the prompt")
    ids_file = Path(args.out).with_suffix(".ids.json")  # the tokens, for kvpress's run (`--kvpress`)
    ids_file.write_text(json.dumps({"model": args.model, "model_file": str(fetch_model(args.model)),
                                    "prompt": args.prompt, "ids": ids[0].tolist()}))
    configs = ([("full cache", None)] if not args.no_full else []) + [
        (f"{spec} budget={budget}", lambda spec=spec, budget=budget: make_press(spec, budget=budget))
        for spec in split_specs(args.presses) for budget in budgets]
    out = Path(args.out)
    done = {}
    if out.exists():
        for line in out.read_text().splitlines():
            row = json.loads(line)
            if row["model"] == args.model and row["tokens"] == args.tokens and row["prompt"] == args.prompt:
                done[row["config"]] = row
    for config, press in tqdm(configs, desc=args.model):
        if config in done:
            continue
        losses, held = token_losses(model, ids, args.prompt, press() if press else None, config)
        row = {"model": args.model, "prompt": args.prompt, "tokens": args.tokens, "config": config, "held": held,
               "losses": losses}
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        done[config] = row
    runs = [done[config] for config, _ in configs] + [row for config, row in done.items()
                                                       if config.startswith("kvpress")]
    quarter = args.tokens // 4
    rows = [{"config": run["config"], "held": run["held"], "ppl": perplexity(run["losses"]),
             "last": perplexity(run["losses"][-quarter:])} for run in runs]
    print(format_table(rows, [("configuration", "config", "s"), ("most tokens held", "held", "d"),
                              ("perplexity", "ppl", ".2f"), (f"last {quarter} tokens", "last", ".2f")]))
    if args.plot:
        plot(runs, args.plot, f"{args.model}: {args.tokens} tokens of Python's reference manual past "
             f"{args.prompt}", args.bucket)


if __name__ == "__main__":
    main()
