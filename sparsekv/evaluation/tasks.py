"""RULER-style synthetic tasks, generated locally at a length in model tokens, and the prose needle tasks
(`prose`) registered beside them.

Each task is a function `(tokenizer, length, seed, depth, haystack) -> Sample`:
- `length`: the whole prompt (chat template, question and answer prefix included) in the tokenizer's tokens,
  within 2%; filler is added or removed in whole units (sentences or list words) until it fits.
- `seed`: every random choice (keys, values, distractor depths, word lists); the same seed gives the same sample.
- `depth`: where the needle goes, 0 (start of the haystack) to 1 (end); tasks without a needle ignore it.
- `haystack`: sentences of the user's own text, repeated as needed; None uses RULER's noise sentences.

Scoring follows RULER: every task here expects all its answers ("all").
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .prompts import Sample, fit_length, weave
from .prose import PROSE_TASKS
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


def _needles(tokenizer, length, seed, depth, haystack, *, n_keys: int, n_values: int, asked: int, task: str) -> Sample:
    """The niah family: `n_keys` keys with `n_values` numbers each; the question asks for the first `asked` keys.

    The first needle goes at `depth`, the others at random depths (distractors when they are not asked for).
    """
    rng = random.Random(seed)
    keys = rng.sample(WORDS, n_keys)
    values = [[_number(rng) for _ in range(n_values)] for _ in keys]
    needles = [NUMBER_NEEDLE.format(key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    depths = [depth] + [rng.random() for _ in needles[1:]]
    asked_keys = ", ".join(keys[: asked - 1]) + (" and " if asked > 1 else "") + keys[asked - 1]
    if asked > 1 or n_values > 1:
        question = f"What are all the special magic numbers for {asked_keys} mentioned in the provided text?"
        prefix = f"The special magic numbers for {asked_keys} mentioned in the provided text are"
    else:
        question = f"What is the special magic number for {asked_keys} mentioned in the provided text?"
        prefix = f"The special magic number for {asked_keys} mentioned in the provided text is"
    answers = [v for vs in values[:asked] for v in vs]

    def make(n: int) -> Sample:
        context = f"{INTRO}\n{weave(_filler(haystack, n), list(zip(depths, needles)))}"
        return Sample(context, question, answers, "all", prefix, depth)

    return fit_length(tokenizer, length, make, task)


def niah_single(tokenizer, length, seed=0, depth=0.5, haystack=None) -> Sample:
    """One key, one 7-digit number hidden in the haystack; asks for the number."""
    return _needles(tokenizer, length, seed, depth, haystack, n_keys=1, n_values=1, asked=1, task="niah_single")


def niah_multikey(tokenizer, length, seed=0, depth=0.5, haystack=None) -> Sample:
    """Four keys with one number each; asks for one of them, the three others are distractors."""
    return _needles(tokenizer, length, seed, depth, haystack, n_keys=4, n_values=1, asked=1, task="niah_multikey")


def niah_multivalue(tokenizer, length, seed=0, depth=0.5, haystack=None) -> Sample:
    """One key with four numbers; asks for all four."""
    return _needles(tokenizer, length, seed, depth, haystack, n_keys=1, n_values=4, asked=1, task="niah_multivalue")


def niah_multiquery(tokenizer, length, seed=0, depth=0.5, haystack=None) -> Sample:
    """Four keys with one number each; asks for all four numbers."""
    return _needles(tokenizer, length, seed, depth, haystack, n_keys=4, n_values=1, asked=4, task="niah_multiquery")


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


def variable_tracking(tokenizer, length, seed=0, depth=0.5, haystack=None, hops: int = 4) -> Sample:
    """A chain `VAR A = 12345`, `VAR B = VAR A`, ... of `hops + 1` variables; asks for every variable holding it.

    The chain starts at `depth`; its other links follow, spread evenly between there and the end.
    """
    rng = random.Random(seed)
    names = ["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(hops + 1)]
    value = _number(rng, 5)
    links = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    depths = [depth + (1 - depth) * i / len(links) for i in range(len(links))]
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    question = f"Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f"Answer: According to the chain(s) of variable assignment in the text above, {len(names)} variables "
        f"are assigned the value {value}, they are:"
    )

    def make(n: int) -> Sample:
        context = f"{intro}\n{weave(_filler(haystack, n), list(zip(depths, links)))}"
        return Sample(context, question, names, "all", prefix, depth)

    return fit_length(tokenizer, length, make, "variable_tracking")


def _word_list(seed: int, n_common: int, n_rare: int) -> tuple[list[str], list[str]]:
    """`n_common` words and `n_rare` other distinct words; past the word list, hyphenated pairs of rare words."""
    words = random.Random(seed).sample(WORDS, len(WORDS))
    common, rare = words[:n_common], words[n_common:]
    pairs = (f"{a}-{b}" for a in rare for b in rare if a != b)
    return common, rare[:n_rare] + [next(pairs) for _ in range(max(0, n_rare - len(rare)))]


def common_words(tokenizer, length, seed=0, depth=None, haystack=None, n_common: int = 10) -> Sample:
    """A numbered word list where `n_common` words repeat more often than the others; asks for those.

    Common words appear up to 30 times and the others up to 3 (fewer for short prompts, as RULER does).
    """
    common_freq = max(2, min(30, length // 128))
    rare_freq = max(1, min(3, common_freq // 10))
    intro = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often."
    )
    question = f"What are the {n_common} most common words in the list above?"
    prefix = f"Answer: The top {n_common} words that appear most often in the list are:"

    def make(n: int) -> Sample:
        common, rare = _word_list(seed, n_common, n)
        listed = common * common_freq + rare * rare_freq
        random.Random(seed * 100_003 + n).shuffle(listed)
        items = " ".join(f"{i}. {w}" for i, w in enumerate(listed, 1))
        return Sample(f"{intro}\n{items}", question, common, "all", prefix)

    return fit_length(tokenizer, length, make, "common_words")


def frequent_words(tokenizer, length, seed=0, depth=None, haystack=None, alpha: float = 2.0) -> Sample:
    """Random coded words with Zipf frequencies (exponent `alpha`); asks for the three most frequent."""
    rng = random.Random(seed)
    coded = list(dict.fromkeys("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(4096)))
    intro = (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appearing coded words."
    )
    question = "What are the three most frequently appearing coded words in the coded text above?"
    prefix = "Answer: According to the coded text above, the three most frequently appearing coded words are:"

    def make(n: int) -> Sample:
        ranks = max(4, min(len(coded), n // 10))
        weights = [r**-alpha for r in range(1, ranks + 1)]
        counts = [max(1, round(n * w / sum(weights))) for w in weights]
        for r in (2, 1, 0):  # the top three are strictly ordered, whatever `n`
            counts[r] = max(counts[r], counts[r + 1] + 1)
        text = [w for w, c in zip(coded, counts) for _ in range(c)]
        random.Random(seed * 100_003 + n).shuffle(text)
        return Sample(f"{intro}\n{' '.join(text)}", question, coded[:3], "all", prefix)

    return fit_length(tokenizer, length, make, "frequent_words")


@dataclass(frozen=True)
class Task:
    """A task generator, its generation budget (new tokens, enough for its answers) and its family.

    The family keeps tasks apart in reports: "ruler" (the noise haystack, unless `--haystack` replaces it) and
    "prose" (needles in real text, `prose`).
    """

    make: Callable[..., Sample]
    max_new_tokens: int
    family: str = "ruler"


TASKS: dict[str, Task] = {
    "niah_single": Task(niah_single, 24),
    "niah_multikey": Task(niah_multikey, 24),
    "niah_multivalue": Task(niah_multivalue, 64),
    "niah_multiquery": Task(niah_multiquery, 64),
    "variable_tracking": Task(variable_tracking, 32),
    "common_words": Task(common_words, 96),
    "frequent_words": Task(frequent_words, 48),
    "passkey": Task(passkey, 16),
}


TASKS.update({name: Task(make, tokens, "prose") for name, (make, tokens) in PROSE_TASKS.items()})
