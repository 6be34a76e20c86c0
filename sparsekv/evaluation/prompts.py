"""Turning a task sample into model tokens, split where the question starts.

The prompt is one user message (context, a newline, the question) in the model's chat template, followed by
the start of the assistant's reply, the task's answer prefix (as RULER does). It is tokenized in two parts,
the context (everything up to the end of the context) and the question (the rest), so that "question" mode
feeds their concatenation to `generate` and "question-agnostic" mode compresses the context alone: both see
the very same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

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
