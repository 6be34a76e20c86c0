"""The needle-in-a-haystack prompt of the demo and the benchmark: the evaluation's `niah_single` task.

A haystack of RULER's noise sentences hides one needle, "One of the special magic numbers for {key} is:
{number}.", at a chosen depth; the question at the end asks for the number, and the assistant's reply starts
with RULER's answer prefix, so the number is the first thing generated.
"""

from __future__ import annotations

import torch

from .evaluation.prompts import encode
from .evaluation.scoring import score
from .evaluation.tasks import niah_single


def build_needle_prompt(tokenizer, n_tokens: int, depth: float = 0.5, seed: int = 0) -> tuple[torch.Tensor, str]:
    """A `(1, L)` prompt of about `n_tokens` model tokens (within 2%, chat template included) and its answer.

    Args:
        tokenizer: the model's tokenizer; its chat template wraps the prompt as a user message.
        n_tokens: target prompt length in tokens.
        depth: where the needle sits in the haystack, 0 (start) to 1 (end).
        seed: picks the key word and the 7-digit number (deterministic).
    """
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1]; got {depth!r}.")
    sample = niah_single(tokenizer, n_tokens, seed=seed, depth=depth)
    return encode(tokenizer, sample).ids, sample.answers[0]


def score_answer(text: str, answer: str) -> bool:
    """True when the generated `text` contains the `answer` (RULER's match)."""
    return score(text, [answer], "all") == 1.0
