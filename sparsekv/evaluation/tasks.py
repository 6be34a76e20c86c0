"""The local tasks, generated at a length in model tokens: RULER's own configuration (`ruler`), quick needles
in RULER's noise haystack (here), and needles in real prose (`prose`).

Each task is a function `(tokenizer, length, seed, depth, haystack) -> Sample`:
- `length`: the whole prompt (chat template, question and answer prefix included) in the tokenizer's tokens:
  within 2% for the quick and prose tasks (filler is added or removed in whole units until it fits); for
  RULER's, the prompt and the tokens its answer may take fit in it, as RULER fills them.
- `seed`: every random choice (keys, values, distractor depths, word lists); the same seed gives the same sample.
- `depth`: where the needle goes, 0 (start of the haystack) to 1 (end); RULER's tasks draw their own depths.
- `haystack`: sentences of the user's own text, repeated as needed; None uses each task's own.

Scoring follows RULER: every task here expects all its answers ("all").
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .prompts import Sample, fit_length, weave
from .prose import PROSE_TASKS
from .ruler import RULER_TASKS
from .words import WORDS

__all__ = ["TASKS", "Sample", "Task", "fit_length", "read_haystack"]

# RULER's noise haystack and instructions.
NOISE = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]
INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
NUMBER_NEEDLE = "One of the special magic numbers for {key} is: {value}."


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def read_haystack(path: str | Path) -> list[str]:
    """The sentences of a text file, for `--haystack`; raises ValueError when it cannot be read or is empty."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--haystack: cannot read {str(path)!r}: {err}") from None
    sentences = []
    for sentence in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
        words = sentence.split()
        sentences += [" ".join(words[i : i + 40]) for i in range(0, len(words), 40)]  # no endless "sentences"
    if not sentences:
        raise ValueError(f"--haystack: {str(path)!r} has no text.")
    return sentences


def _filler(haystack: list[str] | None, n: int) -> list[str]:
    source = haystack or NOISE
    return [source[i % len(source)] for i in range(n)]


def _needles(tokenizer, length, seed, depth, haystack, *, n_keys: int, task: str) -> Sample:
    """`n_keys` keys with one number each; the question asks for the first, whose needle goes at `depth`, the
    others (distractors) at random depths."""
    rng = random.Random(seed)
    keys = rng.sample(WORDS, n_keys)
    values = [_number(rng) for _ in keys]
    needles = [NUMBER_NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
    depths = [depth] + [rng.random() for _ in needles[1:]]
    question = f"What is the special magic number for {keys[0]} mentioned in the provided text?"
    prefix = f"The special magic number for {keys[0]} mentioned in the provided text is"

    def make(n: int) -> Sample:
        context = f"{INTRO}\n{weave(_filler(haystack, n), list(zip(depths, needles)))}"
        return Sample(context, question, [values[0]], "all", prefix, depth)

    return fit_length(tokenizer, length, make, task)


def niah_single(tokenizer, length, seed=0, depth=0.5, haystack=None) -> Sample:
    """One key, one 7-digit number hidden in the haystack; asks for the number."""
    return _needles(tokenizer, length, seed, depth, haystack, n_keys=1, task="niah_single")


def niah_multikey(tokenizer, length, seed=0, depth=0.5, haystack=None) -> Sample:
    """Four keys with one number each; asks for one of them, the three others are distractors."""
    return _needles(tokenizer, length, seed, depth, haystack, n_keys=4, task="niah_multikey")


def passkey(tokenizer, length, seed=0, depth=0.5, haystack=None) -> Sample:
    """A 5-digit pass key hidden in the haystack (Mohtashami & Jaggi's passkey retrieval)."""
    key = _number(random.Random(seed), 5)
    intro = (
        "There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about it afterwards."
    )
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."

    def make(n: int) -> Sample:
        context = f"{intro}\n{weave(_filler(haystack, n), [(depth, needle)])}"
        return Sample(context, "What is the pass key?", [key], "all", "The pass key is", depth)

    return fit_length(tokenizer, length, make, "passkey")


@dataclass(frozen=True)
class Task:
    """A task generator, its generation budget (new tokens, enough for its answers) and its family.

    The family keeps tasks apart in reports: "ruler" (RULER's own configuration, `ruler`: the mean kvpress's
    leaderboard reports), "noise" (quick needles at a set depth in RULER's noise haystack, unless `--haystack`
    replaces it) and "prose" (needles in real text, `prose`).
    """

    make: Callable[..., Sample]
    max_new_tokens: int
    family: str


TASKS: dict[str, Task] = {name: Task(make, tokens, "ruler") for name, (make, tokens) in RULER_TASKS.items()}
TASKS.update({
    "niah_single": Task(niah_single, 24, "noise"),
    "niah_multikey": Task(niah_multikey, 24, "noise"),
    "passkey": Task(passkey, 16, "noise"),
})
TASKS.update({name: Task(make, tokens, "prose") for name, (make, tokens) in PROSE_TASKS.items()})
