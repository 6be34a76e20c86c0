"""Sentences of a tokenized prompt, for presses that work sentence by sentence (SentenceKV).

The token ids are decoded token by token (so every character belongs to exactly one token), nltk's Punkt
algorithm finds the sentences of that text (trained on the text itself: unsupervised, nothing downloaded),
blank lines end sentences too, and each token belongs to the sentence holding its last character. Tokens that
merge punctuation with what follows (`.\\n`, `."`) therefore end their sentence. Sentences longer than the
mean + 2 std of the prompt's sentence lengths (but at least `MIN_CUT` tokens), and any longer than `max_tokens`,
are cut into equal pieces no longer than that (the SentenceKV paper's A.7 mitigation).
"""

from __future__ import annotations

import re
import weakref

import numpy as np
import torch
from nltk.tokenize.punkt import PunktSentenceTokenizer

# Sentences this short are never cut (about the paper's median sentence, 25-30 tokens, A.4): in a text of
# near-identical sentences, mean + 2 std is barely above the mean and would cut every slightly longer one.
MIN_CUT = 32
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")
_CLOSING = re.compile(r"[.!?。！？][\"')\]]*\s*$|\n")


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text, decoded alone. Each distinct id is decoded once: a prompt of 32k tokens holds about 3k,
    and decoding is most of the time segmentation takes (0.25 s for every token at 32k, 0.01 s for each id once)."""
    distinct = list(dict.fromkeys(ids))
    texts = dict(zip(distinct, tokenizer.batch_decode([[i] for i in distinct], skip_special_tokens=False,
                                                      clean_up_tokenization_spaces=False)))
    return [texts[i] for i in ids]


def sentence_starts(text: str) -> np.ndarray:
    """Character offsets where sentences start: Punkt's sentences, also split at blank lines."""
    starts = [start for start, _ in PunktSentenceTokenizer(text).span_tokenize(text)] if text.strip() else []
    starts += [m.end() for m in _BLANK_LINE.finditer(text)]
    return np.unique(np.array([0, *starts], dtype=np.int64))


def split_long(ids: np.ndarray, max_tokens: int | None, floor: int = MIN_CUT) -> np.ndarray:
    """Renumber sentences `ids` (consecutive, non-decreasing) so none is longer than mean + 2 std tokens, or
    `floor` when that is larger (nor `max_tokens`)."""
    _, first, lengths = np.unique(ids, return_index=True, return_counts=True)
    limit = max(lengths.mean() + 2 * lengths.std(), floor) if len(lengths) > 1 else np.inf
    limit = min(limit, max_tokens or np.inf)
    if limit == np.inf:
        return ids
    limit = max(1, int(limit))
    offset = np.arange(len(ids)) - np.repeat(first, lengths)  # index of each token inside its sentence
    pieces = -(-lengths // limit)  # pieces each sentence is cut into, of equal sizes
    size = -(-lengths // pieces)
    return np.repeat(np.cumsum(pieces) - pieces, lengths) + offset // np.repeat(size, lengths)


def sentence_ids(tokenizer, input_ids: torch.Tensor, valid: torch.Tensor | None = None,
                 max_tokens: int | None = None) -> torch.Tensor:
    """Sentence index of every token `(batch, n)`, counted from 0 in each row; -1 for padding."""
    out = torch.full(input_ids.shape, -1, dtype=torch.long)
    if valid is None:
        valid = torch.ones(input_ids.shape, dtype=torch.bool)
    for row, (ids, real) in enumerate(zip(input_ids.tolist(), valid.cpu().tolist())):  # rows, not tokens
        ids = [i for i, r in zip(ids, real) if r]
        if not ids:
            continue
        texts = token_texts(tokenizer, ids)
        ends = np.cumsum([len(t) for t in texts])
        last_char = np.maximum(ends - 1, 0)  # an empty token joins the previous one
        sentence = np.searchsorted(sentence_starts("".join(texts)), last_char, side="right") - 1
        sentence = np.unique(sentence, return_inverse=True)[1]  # renumber 0.. without gaps
        out[row, torch.tensor(real)] = torch.from_numpy(split_long(sentence, max_tokens))
    return out.to(input_ids.device)


def closes_sentence(tokenizer, token_ids: torch.Tensor) -> torch.Tensor:
    """Whether each token `(...)` ends a sentence (final punctuation, or a line break), on `token_ids`' device:
    a lookup in `closing_table`, so that a decoding step reads nothing on the host."""
    table = closing_table(tokenizer).to(token_ids.device)
    return table[token_ids.clamp(max=table.shape[0] - 1)]


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def closing_table(tokenizer) -> torch.Tensor:
    """`(len(tokenizer) + 1,)` on the CPU: whether each token id's text ends a sentence, and a last False for
    ids past the tokenizer's (a model's vocabulary may be padded beyond it). Every token is decoded once per
    tokenizer (0.6 s for SmolLM2's 49k; kept while the tokenizer lives)."""
    try:
        return _TABLES[tokenizer]
    except (KeyError, TypeError):  # (TypeError: a tokenizer that takes no weak reference, made anew each time)
        pass
    texts = token_texts(tokenizer, list(range(len(tokenizer))))
    table = torch.tensor([bool(_CLOSING.search(t)) for t in texts] + [False])
    try:
        _TABLES[tokenizer] = table
    except TypeError:
        pass
    return table
