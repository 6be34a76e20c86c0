"""Needle tasks in real prose: the needle does not stand out from its haystack.

RULER's noise haystack repeats five filler sentences, so any other sentence is an outlier every press finds.
Here the haystack is a contiguous passage of real text, taken at a random place (set by the sample's seed):
by default the prose of Python's own reference manual (`pydoc_data.topics`, shipped with every Python, its
grammar and code blocks left out), or the sentences of a `--haystack FILE`.

The needle is one sentence in the same register as the text around it ("The access code of the amber archive
is KQ7-29XB."), with a value of one of three shapes: a 7-digit number, a code mixing letters, digits and a
dash, or a person's name of two or three words. The question and an answer prefix come at the end of the
prompt; `--mode agnostic` compresses the passage before the question is known.

Tasks (the signature of `tasks.TASKS`: `(tokenizer, length, seed, depth, haystack) -> Sample`):
- `prose_number`, `prose_code`, `prose_name`: one needle.
- `prose_multikey`: four needles of one template (codes) under four keys; the question asks for one, the three
  others are distractors that a press must not confuse with it.
"""

from __future__ import annotations

import random
import re
import string
from functools import lru_cache

from .prompts import Sample, fit_length, weave
from .words import WORDS

__all__ = ["PROSE_TASKS", "prose_sentences"]

INTRO = "Below is a long passage of documentation. Read it carefully: a question about one detail follows."

# The needle templates: (statement, question, answer prefix), each with {key} and the statement with {value}.
TEMPLATES = {
    "number": ("The reference number of the {key} report is {value}.",
               "What is the reference number of the {key} report mentioned in the passage?",
               "The reference number of the {key} report is"),
    "code": ("The access code of the {key} archive is {value}.",
             "What is the access code of the {key} archive mentioned in the passage?",
             "The access code of the {key} archive is"),
    "name": ("The {key} project was led by {value}.",
             "Who led the {key} project mentioned in the passage?",
             "The {key} project was led by"),
}

FIRST = """Ada Amara Bruno Chiara Dmitri Elena Farid Greta Hamid Ingrid Jonas Keiko Lars Leila Matteo Nadia Olu
Priya Quentin Rosa Sanjay Tomas Ulla Viktor Wanjiru Xavier Yara Zoltan""".split()
MIDDLE = "Marie Jean Anne Louise Rose Paul Maria James".split()
LAST = """Abernathy Bergström Castellano Delacroix Eriksen Fitzgerald Gallagher Halvorsen Ibrahim Jankowski Kowalczyk
Lindqvist Marchetti Nakamura Okonkwo Petrakis Quintero Rasmussen Szabo Takahashi Underwood Vasquez Whitfield
Yamamoto Zielinski""".split()


def _value(rng: random.Random, shape: str) -> str:
    if shape == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    if shape == "code":  # three then four characters, each part with at least one letter and one digit
        def part(n: int) -> str:
            chars = [rng.choice(string.ascii_uppercase), rng.choice(string.digits)]
            chars += rng.choices(string.ascii_uppercase + string.digits, k=n - 2)
            rng.shuffle(chars)
            return "".join(chars)
        return f"{part(3)}-{part(4)}"
    middle = [rng.choice(MIDDLE)] if rng.random() < 0.3 else []
    return " ".join([rng.choice(FIRST), *middle, rng.choice(LAST)])


@lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """The sentences of the prose paragraphs of Python's reference manual (`pydoc_data.topics`).

    Indented blocks (grammar rules, code, tables) and heading underlines are left out: what stays is the
    manual's running text, about 35,000 words (~45,000 tokens).
    """
    from pydoc_data.topics import topics

    paragraphs = []
    for text in topics.values():
        for paragraph in re.split(r"\n\s*\n", text):
            lines = paragraph.strip("\n").split("\n")
            if any(line.startswith(" ") for line in lines) or re.fullmatch(r"[*=\-]*", lines[-1].strip()):
                continue
            paragraphs.append(" ".join(paragraph.split()))
    return tuple(s for p in paragraphs for s in re.split(r"(?<=[.!?])\s+", p) if s)


def _passage(sentences, start: int, n: int) -> list[str]:
    """The sentences from `start` (wrapping around the end of the text) holding `n` words in all: the last one is
    cut after its first words when needed, so that a prompt's length is fitted to the word, not to the sentence."""
    passage, i = [], start
    while n > 0:
        words = sentences[i % len(sentences)].split()
        passage.append(" ".join(words[:n]))
        n, i = n - len(words), i + 1
    return passage


def _prose(tokenizer, length, seed, depth, haystack, *, shape: str, n_keys: int, task: str) -> Sample:
    """`n_keys` needles of one shape in a passage of prose; the question asks for the first key's value.

    The first needle goes at `depth`, the others (distractors) at random depths.
    """
    rng = random.Random(seed)
    sentences = haystack or prose_sentences()
    start = rng.randrange(len(sentences))
    keys = rng.sample(WORDS, n_keys)
    values = [_value(rng, shape) for _ in keys]
    statement, question, prefix = TEMPLATES[shape]
    needles = [statement.format(key=k, value=v) for k, v in zip(keys, values)]
    depths = [depth] + [rng.random() for _ in needles[1:]]

    def make(n: int) -> Sample:  # n: words of the passage
        context = f"{INTRO}\n\n{weave(_passage(sentences, start, n), list(zip(depths, needles)))}"
        return Sample(context, question.format(key=keys[0]), [values[0]], "all",
                      prefix.format(key=keys[0]), depth)

    return fit_length(tokenizer, length, make, task)


def prose_number(tokenizer, length, seed=0, depth=0.5, haystack=None) -> Sample:
    """One needle in prose: a 7-digit reference number."""
    return _prose(tokenizer, length, seed, depth, haystack, shape="number", n_keys=1, task="prose_number")


def prose_code(tokenizer, length, seed=0, depth=0.5, haystack=None) -> Sample:
    """One needle in prose: an access code of letters, digits and a dash (`KQ7-29XB`)."""
    return _prose(tokenizer, length, seed, depth, haystack, shape="code", n_keys=1, task="prose_code")


def prose_name(tokenizer, length, seed=0, depth=0.5, haystack=None) -> Sample:
    """One needle in prose: a person's name of two or three words."""
    return _prose(tokenizer, length, seed, depth, haystack, shape="name", n_keys=1, task="prose_name")


def prose_multikey(tokenizer, length, seed=0, depth=0.5, haystack=None) -> Sample:
    """Four access codes under four keys in prose; asks for one, the three others are distractors."""
    return _prose(tokenizer, length, seed, depth, haystack, shape="code", n_keys=4, task="prose_multikey")


# name -> (generator, new tokens enough for the answer)
PROSE_TASKS = {"prose_number": (prose_number, 24), "prose_code": (prose_code, 24), "prose_name": (prose_name, 24),
               "prose_multikey": (prose_multikey, 24)}
