"""kvpress's presses on the very prompts of `sparsekv eval`, for the "at or above its kvpress counterpart" check.

kvpress pins transformers < 5.3 and sparsekv needs >= 5.24, so the two never share a venv. Three steps, each in
the venv it needs, passing token ids through files so that both libraries see the same tokens:

    # 1. sparsekv's venv: the prompts of `sparsekv eval --tasks prose_code --lengths 4096 --samples 20` (seed 0)
    python -m benchmarks.kvpress_compare export --model smollm2-135m --task prose_code --length 4096 \
        --samples 20 --out prompts.jsonl
    # 2. a venv with kvpress (`pip install kvpress gguf torch==2.13.0`): greedy replies under each press and ratio
    python -m benchmarks.kvpress_compare run --prompts prompts.jsonl --presses snapkv,chunkkv,streamingllm,observed \
        --ratios 0.25,0.1,0.05 --out replies.jsonl
    # 3. sparsekv's venv: scored with `sparsekv eval`'s scoring, one row per press and ratio
    python -m benchmarks.kvpress_compare score --replies replies.jsonl

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
`adakv:press=expectedattention`; `knorm` KnormPress / KnormPress.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def export(args) -> None:
    """Write the prompts `sparsekv eval` would build, as token ids, with the model file they belong to."""
    from transformers import AutoTokenizer

    from sparsekv.evaluation.prompts import encode
    from sparsekv.evaluation.runner import local_samples
    from sparsekv.evaluation.tasks import TASKS
    from sparsekv.models import fetch_model

    path = fetch_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    samples = local_samples(args.task, tokenizer, args.length, args.samples, args.seed)
    new_tokens = TASKS[args.task].max_new_tokens
    with open(args.out, "w") as out:
        for i, sample in enumerate(samples):
            prompt = encode(tokenizer, sample)
            out.write(json.dumps({
                "model": str(path), "task": args.task, "length": args.length, "sample": i,
                "depth": sample.depth, "answers": sample.answers, "metric": sample.metric,
                "context_ids": prompt.context_ids[0].tolist(), "question_ids": prompt.question_ids[0].tolist(),
                "max_new_tokens": new_tokens}) + "\n")
    print(f"{len(samples)} prompts -> {args.out}")


def make_press(name: str, ratio: float):
    """kvpress's press `name` keeping `ratio` of the KV."""
    from kvpress import (
        AdaKVPress, ChunkKVPress, ExpectedAttentionPress, KnormPress, ObservedAttentionPress, PyramidKVPress,
        SnapKVPress, StreamingLLMPress,
    )

    removed = 1.0 - ratio
    presses = {
        "snapkv": lambda: SnapKVPress(compression_ratio=removed),
        "adakv": lambda: AdaKVPress(SnapKVPress(compression_ratio=removed)),
        "pyramidkv": lambda: PyramidKVPress(compression_ratio=removed),
        "expectedattention": lambda: ExpectedAttentionPress(compression_ratio=removed),
        "adakv-expectedattention": lambda: AdaKVPress(ExpectedAttentionPress(compression_ratio=removed)),
        "knorm": lambda: KnormPress(compression_ratio=removed),
        "chunkkv": lambda: ChunkKVPress(press=SnapKVPress(compression_ratio=removed)),
        "streamingllm": lambda: StreamingLLMPress(compression_ratio=removed),
        "observed": lambda: ObservedAttentionPress(compression_ratio=removed),
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
        with press(model):
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
        done = {(r["press"], r["ratio"], r["sample"]) for r in map(json.loads, Path(args.out).read_text().splitlines())}
    versions = {"kvpress": getattr(kvpress, "__version__", "?"),
                "transformers": transformers.__version__, "torch": torch.__version__}
    ratios = [float(r) for r in args.ratios.split(",")]
    jobs = [(name, ratio, p) for name in args.presses.split(",") for ratio in ratios for p in prompts
            if (name, ratio, p["sample"]) not in done]
    with open(args.out, "a") as out:
        for name, ratio, prompt in tqdm(jobs, desc="kvpress replies"):
            attention = "eager" if name == "observed" else "sdpa"
            if attention not in models:
                model = AutoModelForCausalLM.from_pretrained(
                    path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation=attention).eval()
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


def score(args) -> None:
    """Accuracy (%) per press and ratio, with `sparsekv eval`'s scoring and a 95% Wilson interval."""
    from sparsekv.evaluation.report import wilson
    from sparsekv.evaluation.scoring import aggregate
    from sparsekv.evaluation.scoring import score as score_reply
    from sparsekv.table import format_table

    cells: dict[tuple[str, float, str], list[float]] = {}
    for record in map(json.loads, Path(args.replies).read_text().splitlines()):
        key = (record["press"], record["ratio"], record["mode"])
        cells.setdefault(key, []).append(score_reply(record["reply"], record["answers"], record["metric"]))
    rows = []
    for (press, ratio, mode), scores in sorted(cells.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        low, high = wilson(aggregate(scores), len(scores))
        rows.append({"press": f"kvpress {press}", "ratio": ratio, "mode": mode, "samples": len(scores),
                     "accuracy": aggregate(scores), "interval": f"[{low:.0f}, {high:.0f}]"})
    print(format_table(rows, [("press", "press", ""), ("ratio", "ratio", ".2f"), ("mode", "mode", ""),
                              ("samples", "samples", "d"), ("accuracy %", "accuracy", ".0f"),
                              ("95% interval", "interval", "")]))


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
    args = parser.parse_args()
    {"export": export, "run": run, "score": score}[args.step](args)


if __name__ == "__main__":
    main()
