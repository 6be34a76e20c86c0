"""Optional benchmark data from the Hugging Face Hub: `ruler:<task>` and `longbench:<task>` in `--tasks`.

Loaded with `datasets` when the Hub is reachable; otherwise `load_hub_task` prints why the task is skipped and
returns None, and the local tasks still run.

- `ruler:<task>` (e.g. `ruler:niah_single_1`, `ruler:qa_1`): RULER's own samples at `--lengths` (4096, 8192,
  16384, ...), from a public export with context, question, answer prefix and answers. Scored as RULER does:
  "any" for its QA tasks, "all" for the others.
- `longbench:<task>` (e.g. `longbench:hotpotqa`): LongBench samples whose prompt fits in `--lengths` tokens,
  scored by substring match ("any"). LongBench's own F1 / ROUGE metrics are not reimplemented, so only its
  short-answer tasks (QA, retrieval, counting) give meaningful numbers.
"""

from __future__ import annotations

import sys

from ..models import require
from .prompts import Sample, encode

HUB_DATASETS = {"ruler": "simonjegou/ruler", "longbench": "Xnhyacinth/LongBench"}


def is_hub_task(name: str) -> bool:
    source, _, task = name.partition(":")
    return source in HUB_DATASETS and bool(task)


def _rows(source: str, task: str, length: int):
    """The dataset's rows for `task` (raises when the Hub or the dataset cannot be reached)."""
    require("datasets", "eval", "for Hub tasks")
    from datasets import load_dataset
    from huggingface_hub import HfApi

    repo = HUB_DATASETS[source]
    HfApi().dataset_info(repo, timeout=10)  # fails fast when offline, where load_dataset would retry
    if source == "ruler":
        return load_dataset(repo, str(length), split="test").filter(lambda row: row["task"] == task)
    return load_dataset(repo, task, split="test")


def to_sample(source: str, task: str, row: dict) -> Sample:
    """One dataset row as a `Sample`."""
    if source == "ruler":
        answers = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
        metric = "any" if task.startswith("qa") else "all"
        return Sample(row["context"], row["question"], [str(a) for a in answers], metric, row["answer_prefix"])
    return Sample(row["context"], row["input"], [str(a) for a in row["answers"]], "any", "Answer:")


def load_hub_task(name: str, length: int, n: int, tokenizer) -> tuple[list[Sample], int] | None:
    """Up to `n` samples of the Hub task `name` that fit in `length` tokens, and the new tokens to generate.

    Returns None, after printing why, when the Hub or the dataset is unreachable.
    """
    source, _, task = name.partition(":")
    try:
        rows = _rows(source, task, length)
    except Exception as err:  # offline, unknown config, missing package: the sweep goes on without it
        print(f"sparsekv eval: skipping {name}: cannot load it from the Hugging Face Hub "
              f"({type(err).__name__}: {err}).", file=sys.stderr)
        return None
    samples, new_tokens = [], []
    for row in rows:
        sample = to_sample(source, task, row)
        if len(encode(tokenizer, sample)) <= length:
            samples.append(sample)
            new_tokens.append(int(row.get("max_new_tokens") or 64))
        if len(samples) == n:
            break
    if not samples:
        print(f"sparsekv eval: skipping {name}: no sample fits in {length} tokens.", file=sys.stderr)
        return None
    return samples, max(new_tokens)
