"""RULER's own task configuration (Hsieh et al., 2024; `scripts/synthetic.yaml` of NVIDIA/RULER), generated
locally: the thirteen tasks that kvpress's leaderboard averages, less the two that need downloads.

| task | haystack | keys | values | needles |
| --- | --- | --- | --- | --- |
| `niah_single_1` | noise | words | 7-digit numbers | 1 |
| `niah_single_2` | essay | words | numbers | 1 |
| `niah_single_3` | essay | words | UUIDs | 1 |
| `niah_multikey_1` | essay | words | numbers | 4 keys, 1 asked |
| `niah_multikey_2` | needles (every line a needle) | words | numbers | 1 asked |
| `niah_multikey_3` | needles | UUIDs | UUIDs | 1 asked |
| `niah_multivalue` | essay | words | numbers | 1 key, 4 values |
| `niah_multiquery` | essay | words | numbers | 4 keys, 4 asked |
| `vt` | noise | 1 chain of 4 hops, after one worked example | | |
| `cwe` | numbered word list, 10 words 30 times, the others 3 times, after one worked example | | | |
| `fwe` | coded words with Zipf (alpha 2) frequencies; the three most frequent asked | | | |

`qa_1` (SQuAD) and `qa_2` (HotpotQA) need datasets this package cannot ship: `ruler:qa_1` loads kvpress's export
of them where the Hugging Face Hub is reachable.

As RULER: its templates, needles, answer prefixes and tokens to generate (128 for the needles, 30 for `vt`, 120
for `cwe`, 50 for `fwe`); needle depths drawn from its 40 depths (essays) or uniformly (noise, needles); the
prompt filled until it and the tokens to generate fit in `length`; string_match_all scoring. Where sparsekv
chose (RULER's sources are downloads): the essay is the prose of Python's reference manual (`pydoc_data.topics`,
from its start, as RULER reads its Paul Graham essays from theirs) or `--haystack FILE`; the key words are
adjective-noun pairs from `words` (RULER: wonderwords' lists); `length` counts the prompt in the model's chat
template (RULER counts its base template). Every random choice follows the sample's `seed`; the sweep's `depth`
is not used, RULER draws its own.
"""

from __future__ import annotations

import math
import random
import string
import uuid
from typing import Callable

from .prompts import Sample, encode
from .prose import prose_sentences
from .words import ADJECTIVES, WORDS

__all__ = ["RULER_TASKS", "UNSHIPPED"]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's depths, percent: np.linspace(0, 100, 40) rounded
UNSHIPPED = {"qa_1": "SQuAD", "qa_2": "HotpotQA"}


def fit_within(tokenizer, budget: int, make: Callable[[int], Sample], task: str) -> Sample:
    """`make(n)` for the largest haystack size `n` whose prompt has at most `budget` tokens (RULER's binary
    search; `n` counts words, lines or list items, as the task's haystack does)."""
    def size(n: int) -> int:
        return len(encode(tokenizer, make(n)))

    if size(1) > budget:
        raise ValueError(f"--lengths: too short for task {task!r}: its smallest prompt has {size(1)} tokens and "
                         f"{budget} are left once its answer is generated.")
    lo, hi = 1, 2
    while size(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # size(lo) fits, size(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= budget else (lo, mid)
    return make(lo)


def _draw(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(WORDS)}"


def _essay(haystack: list[str] | None, n_words: int) -> list[str]:
    """The first `n_words` words of the essay, as sentences (the last one cut short)."""
    out, left = [], n_words
    sentences = haystack or prose_sentences()
    for i in range(len(sentences) * (n_words // 10 + 1)):  # wraps around a short `--haystack`
        if left <= 0:
            break
        words = sentences[i % len(sentences)].split()[:left]
        out.append(" ".join(words))
        left -= len(words)
    return out


def niah(tokenizer, length, seed, haystack, *, kind: str, key: str = "words", value: str = "numbers",
         n_keys: int = 1, n_values: int = 1, n_queries: int = 1, task: str = "niah") -> Sample:
    """RULER's `niah.py`: `n_keys` keys with `n_values` values each in a haystack of `kind` ("noise", "essay" or
    "needle"); the question asks for `n_queries` keys' values."""
    rng = random.Random(seed)
    n_keys = max(n_keys, n_queries)
    keys = [_draw(rng, key) for _ in range(n_keys)]
    values = [[_draw(rng, value) for _ in range(n_values)] for _ in keys]
    needles = [NEEDLE.format(type_v=value, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    random.Random(seed).shuffle(needles)
    if kind == "essay":
        depths = [d / 100 for d in sorted(rng.sample(DEPTHS, len(needles)))]
    else:
        depths = sorted(rng.random() for _ in needles)
    asked = rng.sample(range(n_keys), n_queries)
    query = ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]] if n_queries > 1 else keys[asked[0]]
    answers = [v for i in asked for v in values[i]]
    filler_seed = rng.getrandbits(32)

    asked_depth = depths[needles.index(NEEDLE.format(type_v=value, key=keys[asked[0]], value=values[asked[0]][0]))]
    type_v, intro = value, ("Some special magic {t} are hidden within the following text. Make sure to memorize it. "
                            "I will quiz you about the {t} afterwards.")
    question = "What are all the special magic {t} for {q} mentioned in the provided text?"
    prefix = "The special magic {t} for {q} mentioned in the provided text are"
    if n_queries * n_values == 1:  # RULER's singular wording
        type_v = value[:-1]
        intro, question, prefix = (s.replace("Some", "A").replace("are all", "is").replace("are", "is")
                                   for s in (intro, question, prefix))
    intro, question = intro.format(t=type_v), question.format(t=type_v, q=query)
    prefix = prefix.format(t=type_v, q=query)

    def make(n: int) -> Sample:
        if kind == "essay":  # each needle before the sentence at its depth
            sentences, parts = _essay(haystack, n), []
            at = [int(len(sentences) * d) for d in depths]
            for i, sentence in enumerate(sentences):
                parts += [needle for needle, a in zip(needles, at) if a == i] + [sentence]
            context = " ".join(parts + [needle for needle, a in zip(needles, at) if a >= len(sentences)])
        else:
            filler_rng = random.Random(filler_seed)  # the same lines for every n, one more line at a time
            lines = [NOISE if kind == "noise" else NEEDLE.format(
                type_v=value, key=_draw(filler_rng, key), value=_draw(filler_rng, value)) for _ in range(n)]
            for d, needle in sorted(zip(depths, needles), reverse=True):
                lines.insert(int(d * n), needle)
            context = "\n".join(lines)
        return Sample(f"{intro}\n{context}", question, answers, "all", prefix, asked_depth)

    return fit_within(tokenizer, length - 128, make, task)


def vt(tokenizer, length, seed=0, depth=None, haystack=None, hops: int = 4) -> Sample:
    """RULER's `variable_tracking.py`: one chain `VAR A = 12345`, `VAR B = VAR A`, ... of `hops` hops in the noise
    haystack, after one worked example of its own (3-letter names, ~500 tokens); asks for every variable of the
    chain."""
    rng = random.Random(seed)
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    question = "Question: Find all variables that are assigned the value {v} in the text above."
    prefix = ("Answer: According to the chain(s) of variable assignment in the text above, {k} variables are "
              "assigned the value {v}, they are:")

    def chain(letters: int) -> tuple[list[str], str, list[str], list[float]]:
        names: list[str] = []
        while len(names) < hops + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=letters))
            names += [name] if name not in names else []
        value = str(rng.randint(10000, 99999))
        links = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in zip(names, names[1:])]
        return names, value, links, sorted(rng.random() for _ in links)

    def text(n: int, links: list[str], at: list[float]) -> str:
        lines = [NOISE] * n
        for j, d in enumerate(at):  # RULER: each link inserted after the previous one, at a random line
            lines.insert(int(d * n) + j, links[j])
        return "\n".join(lines).replace(". \n", ".\n")

    names, value, links, at = chain(5)
    example_names, example_value, example_links, example_at = chain(3)

    def example(n: int) -> str:
        return (f"{intro}\n\n{text(n, example_links, example_at)}\n{question.format(v=example_value)} "
                f"{prefix.format(k=hops + 1, v=example_value)} {' '.join(example_names)}")

    n = 5  # RULER's example: as many noise lines (in fives) as fit in 500 tokens
    while len(tokenizer(example(n + 5)).input_ids) <= 500:
        n += 5
    shot = example(n)

    def make(n: int) -> Sample:
        return Sample(f"{shot}\n{intro}\n\n{text(n, links, at)}", question.format(v=value), names, "all",
                      prefix.format(k=hops + 1, v=value), at[0])

    return fit_within(tokenizer, length - 30, make, "vt")


def cwe(tokenizer, length, seed=0, depth=None, haystack=None, n_common: int = 10) -> Sample:
    """RULER's `common_words_extraction.py`: a numbered list of words where `n_common` appear 30 times and the
    others 3 times, after one worked example (40 words: 10 times and 3 times); asks for the `n_common`. Below 4k
    tokens, as RULER: 6 times and once, after an example of 20 words (3 times and once)."""
    pool = list(dict.fromkeys(WORDS + ADJECTIVES))
    random.Random(seed).shuffle(pool)
    intro = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
             "ones that appear most often.")
    question = f"Question: What are the {n_common} most common words in the above list?"
    prefix = f"Answer: The top {n_common} words that appear most often in the list are:"

    def listing(words: list[str], common: int, rare: int) -> tuple[str, list[str]]:
        listed = words[:n_common] * common + words[n_common:] * rare
        random.Random(seed).shuffle(listed)
        return " ".join(f"{i}. {w}" for i, w in enumerate(listed, 1)), words[:n_common]

    rng = random.Random(seed)
    short = length < 4096  # RULER's lighter lists below 4k tokens
    shot_list, shot_answer = listing(rng.sample(pool, 20 if short else 40), 3 if short else 10, 1 if short else 3)
    shot = (f"{intro}\n{shot_list}\n{question} {prefix} " + " ".join(f"{i}. {w}" for i, w in enumerate(shot_answer, 1)))
    draw_seed = rng.getrandbits(32)

    def make(n: int) -> Sample:
        words = random.Random(draw_seed).sample(pool, n) if n <= len(pool) else _pairs(pool, n, draw_seed)
        items, answer = listing(words, 6 if short else 30, 1 if short else 3)
        return Sample(f"{shot}\n{intro}\n{items}", question, answer, "all", prefix)

    return fit_within(tokenizer, length - 120, make, "cwe")


def _pairs(pool: list[str], n: int, seed: int) -> list[str]:
    """`n` distinct hyphenated pairs of words, when a prompt wants more words than the pool has (RULER then
    draws from a larger English word list)."""
    rng, out = random.Random(seed), set()
    while len(out) < n:
        out.add(f"{rng.choice(pool)}-{rng.choice(pool)}")
    return sorted(out, key=lambda w: rng.random())


def fwe(tokenizer, length, seed=0, depth=None, haystack=None, alpha: float = 2.0) -> Sample:
    """RULER's `freq_words_extraction.py`: coded 6-letter words with Zipf frequencies (exponent `alpha`), the most
    frequent replaced by dots as noise; asks for the three next."""
    rng = random.Random(seed)
    size = (length - 50) // 50  # RULER's vocabulary size at its default
    vocab: list[str] = []
    while len(vocab) < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        vocab += [word] if word not in vocab else []
    vocab = sorted(vocab)
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."  # RULER: the top-ranked word is noise
    zeta = sum(k**-alpha for k in range(1, 100_000)) + 100_000 ** (1 - alpha) / (alpha - 1)
    intro = ("Read the following coded text and track the frequency of each coded word. Find the three most "
             "frequently appeared coded words.")
    question = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
    prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"

    def make(n: int) -> Sample:
        words = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k**-alpha / zeta))]
        random.Random(seed).shuffle(words)
        return Sample(f"{intro} {' '.join(words)}", question, vocab[1:4], "all", prefix)

    return fit_within(tokenizer, length - 50, make, "fwe")


def _niah(**config) -> Callable[..., Sample]:
    def make(tokenizer, length, seed=0, depth=None, haystack=None) -> Sample:
        return niah(tokenizer, length, seed, haystack, **config)
    make.__doc__ = f"RULER's niah task with {config}."
    return make


# name -> (generator, tokens to generate), RULER's synthetic.yaml and constants.py
RULER_TASKS = {
    "niah_single_1": (_niah(kind="noise", task="niah_single_1"), 128),
    "niah_single_2": (_niah(kind="essay", task="niah_single_2"), 128),
    "niah_single_3": (_niah(kind="essay", value="uuids", task="niah_single_3"), 128),
    "niah_multikey_1": (_niah(kind="essay", n_keys=4, task="niah_multikey_1"), 128),
    "niah_multikey_2": (_niah(kind="needle", task="niah_multikey_2"), 128),
    "niah_multikey_3": (_niah(kind="needle", key="uuids", value="uuids", task="niah_multikey_3"), 128),
    "niah_multivalue": (_niah(kind="essay", n_values=4, task="niah_multivalue"), 128),
    "niah_multiquery": (_niah(kind="essay", n_queries=4, task="niah_multiquery"), 128),
    "vt": (vt, 30),
    "cwe": (cwe, 120),
    "fwe": (fwe, 50),
}
