"""Turning a task sample into model tokens, split where the question starts.

The prompt is one user message (context, a newline, the question) in the model's chat template, followed by
the start of the assistant's reply, the task's answer prefix (as RULER does). It is tokenized in two parts,
the context (everything up to the end of the context) and the question (the rest), so that "question" mode
feeds their concatenation to `generate` and "question-agnostic" mode compresses the context alone: both see
the very same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Sample:
    """One task instance.

    Attributes:
        context: the long text (instructions and haystack).
        question: asked after the context.
        answers: strings expected in the reply.
        metric: "all" (RULER's string_match_all) or "any" (string_match_part), see `scoring`.
        answer_prefix: the start of the assistant's reply; the model continues it.
        depth: where the (first) needle sits, 0 to 1; None for tasks without one.
    """

    context: str
    question: str
    answers: list[str]
    metric: str = "all"
    answer_prefix: str = ""
    depth: float | None = None


@dataclass
class Prompt:
    """A sample's tokens: `context_ids` `(1, Lc)` then `question_ids` `(1, Lq)` (question and answer prefix)."""

    context_ids: torch.Tensor
    question_ids: torch.Tensor

    @property
    def ids(self) -> torch.Tensor:
        return torch.cat([self.context_ids, self.question_ids], dim=1)

    def __len__(self) -> int:
        return self.context_ids.shape[1] + self.question_ids.shape[1]


def encode(tokenizer, sample: Sample) -> Prompt:
    """The sample in the tokenizer's chat template (plain text when it has none), split before the question."""
    joint = f"\n{sample.question}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.context + joint}], add_generation_prompt=True, tokenize=False
        )
        split = text.rfind(joint)
        if split < 0:
            raise ValueError("the tokenizer's chat template changed the question; cannot split context and question.")
        head, tail, special = text[:split], text[split:] + sample.answer_prefix, False
    else:
        head, tail, special = sample.context, f"{joint}\n{sample.answer_prefix}".rstrip(" "), True

    def ids(text: str, add_special_tokens: bool) -> torch.Tensor:
        return torch.tensor([tokenizer(text, add_special_tokens=add_special_tokens).input_ids], dtype=torch.long)

    return Prompt(ids(head, special), ids(tail, False))


def weave(filler: list[str], inserts: list[tuple[float, str]]) -> str:
    """`filler` sentences joined by spaces, each insert `(depth, text)` placed at its depth among them."""
    at: dict[int, list[str]] = {}
    for depth, text in inserts:
        at.setdefault(round(depth * len(filler)), []).append(text)
    out = []
    for i in range(len(filler) + 1):
        out += at.get(i, [])
        out += filler[i : i + 1]
    return " ".join(out)


def fit_length(tokenizer, length: int, make: Callable[[int], Sample], task: str) -> Sample:
    """The sample `make(n)` whose prompt is closest to `length` tokens, `n` being the amount of filler."""
    cache: dict[int, int] = {}

    def size(n: int) -> int:
        if n not in cache:
            cache[n] = len(encode(tokenizer, make(n)))
        return cache[n]

    if size(0) > 1.02 * length:
        raise ValueError(f"--lengths: {length} tokens is too short for task {task!r}: it needs {size(0)} tokens.")
    per_unit = max((size(64) - size(0)) / 64, 1e-3)
    n, lo, hi = max(0, round((length - size(0)) / per_unit)), 0, None
    for _ in range(16):  # secant steps, kept inside the bracket found so far
        if abs(size(n) - length) <= 0.01 * length:
            break
        if size(n) < length:
            lo = n + 1
        else:
            hi = n - 1
        step = n + round((length - size(n)) / per_unit)
        n = max(lo, min(step, hi if hi is not None else step))
        if hi is not None and lo > hi:
            break
    best = min(cache, key=lambda k: abs(cache[k] - length))
    return make(best)
