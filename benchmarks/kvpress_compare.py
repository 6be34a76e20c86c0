"""kvpress's presses on the very prompts of `sparsekv eval`, for the "at or above its kvpress counterpart" check.

kvpress pins transformers < 5.3 and sparsekv needs >= 5.24, so the two never share a venv. Three steps, each in
the venv it needs, passing token ids through files so that both libraries see the same tokens:

    # 1. sparsekv's venv: the prompts of `sparsekv eval --tasks ruler --lengths 4096 --samples 1` (seed 0);
    #    --task takes task names, comma-separated, or ruler (RULER's configuration)
    python -m benchmarks.kvpress_compare export --model smollm2-135m --task ruler --length 4096 \
        --samples 1 --out prompts.jsonl
    # 2. a venv with kvpress (`pip install kvpress gguf torch==2.13.0`): greedy replies under each press and ratio
    #    ("full": no press, run once), ratio by ratio, resumed where an interrupted run stopped
    python -m benchmarks.kvpress_compare run --prompts prompts.jsonl --presses full,snapkv,adakv \
        --ratios 0.75,0.5,0.25,0.125 --mode agnostic --out replies.jsonl
    # 3. sparsekv's venv: scored with `sparsekv eval`'s scoring, one row per press and ratio (the mean over the
    #    tasks), beside sparsekv's own runs of the same prompts (`--sparsekv`), as a table and a plot
    python -m benchmarks.kvpress_compare score --replies replies.jsonl --sparsekv results/smollm2-135m \
        --markdown --plot ruler.png                  # --sparsekv takes several folders

`--mode question` (the default, as `sparsekv eval`'s) compresses the whole prompt, question included, in one
forward under the press; `--mode agnostic` compresses the context alone and reads the question from that cache,
as kvpress's own pipeline does. Decoding then runs outside the press, with each token's position set after the
prompt's (the cache is shorter than the positions it holds), as kvpress's pipeline does. The ratio is the
fraction of the KV kept, sparsekv's convention (kvpress's `compression_ratio` is `1 - ratio`).

kvpress's presses and their sparsekv counterparts: `snapkv` SnapKVPress (its defaults: 64-token window, 5-token
kernel) / SnapKVPress; `chunkkv` ChunkKVPress(SnapKVPress, 20-token chunks) / ChunkPress; `streamingllm`
StreamingLLMPress (4 sinks) / StreamingLLMPress; `observed` ObservedAttentionPress (H2O's accumulated attention
over the prompt, eager attention, prefill only) / H2OPress; `adakv` AdaKVPress(SnapKVPress) / AdaKVPress;
`pyramidkv` PyramidKVPress (64-token window, 5-token kernel) / PyramidKVPress; `expectedattention`
ExpectedAttentionPress / ExpectedAttentionPress; `adakv-expectedattention` AdaKVPress(ExpectedAttentionPress) /
`adakv:press=expectedattention`; `knorm` KnormPress / KnormPress; `kvzip` KVzipPress / KVzipPress (kvpress's
loads the model's tokenizer from `config.name_or_path`: a copy saved beside `--out`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path


def export(args) -> None:
    """Write the prompts `sparsekv eval` would build, as token ids, with the model file they belong to."""
    from transformers import AutoTokenizer

    from sparsekv.evaluation.prompts import encode
    from sparsekv.evaluation.ruler import RULER_TASKS
    from sparsekv.evaluation.runner import local_samples
    from sparsekv.evaluation.tasks import TASKS
    from sparsekv.models import fetch_model

    path = fetch_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tasks = [t for name in args.task.split(",") for t in (RULER_TASKS if name == "ruler" else [name])]
    with open(args.out, "w") as out:
        for task in tasks:
            samples = local_samples(task, tokenizer, args.length, args.samples, args.seed)
            for i, sample in enumerate(samples):
                prompt = encode(tokenizer, sample)
                out.write(json.dumps({
                    "model": str(path), "task": task, "length": args.length, "sample": i,
                    "depth": sample.depth, "answers": sample.answers, "metric": sample.metric,
                    "context_ids": prompt.context_ids[0].tolist(), "question_ids": prompt.question_ids[0].tolist(),
                    "max_new_tokens": TASKS[task].max_new_tokens}) + "\n")
    print(f"{len(tasks)} tasks x {args.samples} prompts -> {args.out}")


def make_press(name: str, ratio: float):
    """kvpress's press `name` keeping `ratio` of the KV."""
    from kvpress import (
        AdaKVPress, ChunkKVPress, ExpectedAttentionPress, KnormPress, KVzipPress, ObservedAttentionPress,
        PyramidKVPress, SnapKVPress, StreamingLLMPress,
    )

    removed = 1.0 - ratio
    presses = {
        "full": lambda: None,
        "snapkv": lambda: SnapKVPress(compression_ratio=removed),
        "adakv": lambda: AdaKVPress(SnapKVPress(compression_ratio=removed)),
        "pyramidkv": lambda: PyramidKVPress(compression_ratio=removed),
        "expectedattention": lambda: ExpectedAttentionPress(compression_ratio=removed),
        "adakv-expectedattention": lambda: AdaKVPress(ExpectedAttentionPress(compression_ratio=removed)),
        "knorm": lambda: KnormPress(compression_ratio=removed),
        "chunkkv": lambda: ChunkKVPress(press=SnapKVPress(compression_ratio=removed)),
        "streamingllm": lambda: StreamingLLMPress(compression_ratio=removed),
        "observed": lambda: ObservedAttentionPress(compression_ratio=removed),
        "kvzip": lambda: KVzipPress(compression_ratio=removed),
    }
    if name not in presses:
        raise SystemExit(f"--presses: {name!r} is not one of {', '.join(presses)}.")
    return presses[name]()


def reply(model, press, context, question, mode: str, max_new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy reply token ids to `context` + `question` `(1, L)` with kvpress's `press` compressing in `mode`."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    first = torch.cat([context, question], dim=1) if mode == "question" else context
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            out = model(first, past_key_values=cache, logits_to_keep=1)
        seen = first.shape[1]
        if mode == "agnostic":  # the question read from the compressed context, at its own positions
            positions = torch.arange(seen, seen + question.shape[1]).unsqueeze(0)
            out = model(question, past_key_values=cache, position_ids=positions, logits_to_keep=1)
            seen += question.shape[1]
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        ids = [token.item()]
        while len(ids) < max_new_tokens and ids[-1] not in eos:
            out = model(token, past_key_values=cache, position_ids=torch.tensor([[seen]]))
            seen += 1
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            ids.append(token.item())
    return ids


def run(args) -> None:
    """Replies under each kvpress press and ratio, appended to `--out` (finished ones skipped on a rerun)."""
    import kvpress
    import torch
    import transformers
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    path = Path(prompts[0]["model"])
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    models = {}  # (model, end-of-sequence ids) by attention: ObservedAttentionPress reads eager's weights
    done = set()
    if Path(args.out).exists():
        done = {(r["press"], r["ratio"], r["task"], r["sample"])
                for r in map(json.loads, Path(args.out).read_text().splitlines())}
    versions = {"kvpress": getattr(kvpress, "__version__", "?"),
                "transformers": transformers.__version__, "torch": torch.__version__}
    ratios = [float(r) for r in args.ratios.split(",")]
    names = args.presses.split(",")  # the full cache first, then ratio by ratio: an interrupted run has them all
    jobs = [("full", 1.0, p) for p in prompts if "full" in names]
    jobs += [(name, ratio, p) for ratio in ratios for name in names if name != "full" for p in prompts]
    jobs = [(name, ratio, p) for name, ratio, p in jobs if (name, ratio, p["task"], p["sample"]) not in done]
    with open(args.out, "a") as out:
        for name, ratio, prompt in tqdm(jobs, desc="kvpress replies"):
            attention = "eager" if name == "observed" else "sdpa"
            if attention not in models:
                model = AutoModelForCausalLM.from_pretrained(
                    path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation=attention).eval()
                # kvpress's KVzip loads the tokenizer from `config.name_or_path`, which a GGUF file is not
                saved = Path(args.out).with_suffix(".tokenizer")
                tokenizer.save_pretrained(saved)
                model.config.name_or_path = str(saved)
                eos = model.generation_config.eos_token_id
                models[attention] = model, set(eos if isinstance(eos, list) else [eos])
            model, eos = models[attention]
            ids = reply(model, make_press(name, ratio), torch.tensor([prompt["context_ids"]]),
                        torch.tensor([prompt["question_ids"]]), args.mode, prompt["max_new_tokens"], eos)
            out.write(json.dumps({
                "press": name, "ratio": ratio, "mode": args.mode, "sample": prompt["sample"],
                "task": prompt["task"], "length": prompt["length"], "answers": prompt["answers"],
                "metric": prompt["metric"], "reply": tokenizer.decode(ids, skip_special_tokens=True),
                **versions}) + "\n")
            out.flush()


def cells(args) -> dict[tuple[str, str, float, str], dict[str, list[float]]]:
    """Per (library, press, kept fraction, mode): each task's sample scores, kvpress's replies beside sparsekv's
    runs (`--sparsekv`, a `sparsekv eval` results folder) on the same tasks, length and mode."""
    from sparsekv.evaluation.report import load_results
    from sparsekv.evaluation.scoring import score as score_reply

    out: dict[tuple[str, str, float, str], dict[str, list[float]]] = {}
    replies = [json.loads(line) for line in Path(args.replies).read_text().splitlines()]
    for r in replies:
        scores = out.setdefault(("kvpress", r["press"], r["ratio"], "-" if r["press"] == "full" else r["mode"]), {})
        scores.setdefault(r.get("task", "-"), []).append(score_reply(r["reply"], r["answers"], r["metric"]))
    if getattr(args, "sparsekv", None):
        tasks, lengths = {r["task"] for r in replies}, {r["length"] for r in replies}
        modes = {r["mode"] for r in replies}
        folders = [args.sparsekv] if isinstance(args.sparsekv, str) else args.sparsekv
        for m in (m for folder in folders for m in load_results(folder)):
            if m["task"] in tasks and m["length"] in lengths and (m["press"] == "full" or m["mode"] in modes):
                key = ("sparsekv", m["press"], m["ratio"], "-" if m["press"] == "full" else m["mode"])
                # a run's score is its samples' mean, weighted back into samples
                out.setdefault(key, {}).setdefault(m["task"], []).extend([m["score"] / 100] * m["samples"])
    return out


def score(args) -> None:
    """Per library, press, kept fraction and mode: the mean over tasks of each task's accuracy (%; RULER's mean,
    a task's accuracy when there is one), with the prompts it pools and their 95% Wilson interval. A row missing
    a task has no mean. `--markdown`: the means as a press x kept-fraction table; `--plot`: score against kept
    fraction, a line per press, kvpress's dashed."""
    from sparsekv.evaluation.report import wilson
    from sparsekv.evaluation.scoring import aggregate
    from sparsekv.table import format_table

    table = cells(args)
    tasks = sorted({t for per_task in table.values() for t in per_task})
    rows = []
    for (library, press, ratio, mode), per_task in sorted(
            table.items(), key=lambda kv: (kv[0][1] != "full", kv[0][1], kv[0][0], -kv[0][2], kv[0][3])):
        n = sum(len(v) for v in per_task.values())
        mean = sum(aggregate(v) for v in per_task.values()) / len(tasks) if set(per_task) == set(tasks) else None
        low, high = wilson(mean, n) if mean is not None else (None, None)
        rows.append({"library": library, "press": f"{library} {press}", "method": press, "ratio": ratio, "mode": mode,
                     "samples": n, "accuracy": mean, "interval": None if mean is None else f"[{low:.0f}, {high:.0f}]"})
    if len(tasks) > 1:
        print(f"mean over {len(tasks)} tasks: {', '.join(tasks)}")
    print(format_table(rows, [("press", "press", ""), ("ratio", "ratio", "g"), ("mode", "mode", ""),
                              ("samples", "samples", "d"), ("accuracy %", "accuracy", ".1f"),
                              ("95% interval", "interval", "")]))
    if getattr(args, "markdown", False):
        print("\n" + markdown(rows))
    if getattr(args, "plot", None):
        plot(rows, args.plot, args.title or Path(args.replies).stem)
        print(f"plot -> {args.plot}")


def markdown(rows: list[dict]) -> str:
    """The means as a Markdown table: a row per library and press, a column per kept fraction (bold: the best of
    each column), the full cache's mean in its own column."""
    ratios = sorted({r["ratio"] for r in rows if r["method"] != "full"}, reverse=True)
    best = {ratio: max((r["accuracy"] or 0) for r in rows if r["ratio"] == ratio) for ratio in ratios}
    presses = list(dict.fromkeys(r["press"] for r in rows))
    lines = ["| press | " + " | ".join(f"kept {r:g}" for r in ratios) + " | full cache | prompts |",
             "|---" + "|---:" * (len(ratios) + 2) + "|"]
    for press in presses:
        mine = {r["ratio"]: r for r in rows if r["press"] == press}
        if press.endswith(" full"):
            cells_ = ["" for _ in ratios] + [f"{mine[1.0]['accuracy']:.1f}"]
        else:
            cells_ = ["-" if ratio not in mine or mine[ratio]["accuracy"] is None else
                      (f"**{mine[ratio]['accuracy']:.1f}**" if mine[ratio]["accuracy"] == best[ratio] else
                       f"{mine[ratio]['accuracy']:.1f}") for ratio in ratios] + [""]
        lines.append(f"| {press} | " + " | ".join(cells_) + f" | {max(r['samples'] for r in mine.values())} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    """Score against kept fraction: a line per press (sparsekv solid, kvpress dashed, one colour per method),
    each library's full cache a horizontal line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.6))
    ax = fig.subplots()
    methods = sorted({r["method"] for r in rows} - {"full"})
    colour = {m: f"C{i}" for i, m in enumerate(methods)}
    ratios = sorted({r["ratio"] for r in rows if r["method"] != "full"})
    for press in dict.fromkeys(r["press"] for r in rows):
        mine = sorted((r for r in rows if r["press"] == press and r["accuracy"] is not None), key=lambda r: r["ratio"])
        if not mine:
            continue
        library, method = mine[0]["library"], mine[0]["method"]
        style = "-" if library == "sparsekv" else "--"
        if method == "full":
            ax.axhline(mine[0]["accuracy"], color="black", linestyle=style, linewidth=1, label=f"{library} full cache")
            continue
        ax.plot([r["ratio"] for r in mine], [r["accuracy"] for r in mine], style, color=colour[method],
                marker="o" if library == "sparsekv" else "s", label=press)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ratios, [f"{r:g}" for r in ratios])
    ax.set_xlabel("fraction of the KV cache kept")
    ax.set_ylabel("mean score (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the lines, never over them
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    e = steps.add_parser("export", help="sparsekv's venv: the eval's prompts as token ids")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--task", default="prose_code")
    e.add_argument("--length", type=int, default=4096)
    e.add_argument("--samples", type=int, default=20)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", default="prompts.jsonl")
    r = steps.add_parser("run", help="kvpress's venv: greedy replies under kvpress's presses")
    r.add_argument("--prompts", default="prompts.jsonl")
    r.add_argument("--presses", default="snapkv,chunkkv,streamingllm,observed")
    r.add_argument("--ratios", default="0.1", help="fractions of the KV kept, comma-separated")
    r.add_argument("--mode", choices=("question", "agnostic"), default="question")
    r.add_argument("--out", default="replies.jsonl")
    s = steps.add_parser("score", help="sparsekv's venv: the replies scored as sparsekv eval scores")
    s.add_argument("--replies", default="replies.jsonl")
    s.add_argument("--sparsekv", nargs="+", help="`sparsekv eval --out` folders (the model's): their runs beside "
                   "kvpress's")
    s.add_argument("--plot", help="PNG file: score against kept fraction, a line per press")
    s.add_argument("--title", help="the plot's title (default: the replies file's name)")
    s.add_argument("--markdown", action="store_true", help="the table in Markdown")
    args = parser.parse_args()
    {"export": export, "run": run, "score": score}[args.step](args)


if __name__ == "__main__":
    main()
