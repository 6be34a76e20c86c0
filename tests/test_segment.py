"""Sentences of tokenized prompts: Punkt over the decoded tokens, blank lines, long sentences cut."""

from __future__ import annotations

import torch
from conftest import TRICKY, make_tokenizer

from sparsekv.presses.sentence_segment import closes_sentence, sentence_ids, split_long, token_texts


def sentences(text: str, **kw) -> list[str]:
    tok = make_tokenizer()
    ids = tok(text)["input_ids"]
    which = sentence_ids(tok, torch.tensor([ids]), **kw)[0].tolist()
    texts = token_texts(tok, ids)
    assert which == sorted(which) and which[0] == 0  # consecutive sentences, numbered from 0 without gaps
    assert set(which) == set(range(max(which) + 1))
    return ["".join(t for t, s in zip(texts, which) if s == k) for k in range(max(which) + 1)]


def test_abbreviations_decimals_quotes_code_and_merged_punctuation():
    got = [s.strip() for s in sentences(TRICKY)]
    assert got[0].startswith("Dr. Smith paid $3.50 for the U.S. edition")  # abbreviations and decimals
    assert "It was 2.5 times cheaper." in got  # "cheaper" + ".\n": the merged token ends the sentence
    assert '"Is it good?"' in " ".join(got) and "x = 1.5\nprint(x)" in got and "def f():\n    return x" in got
    assert any(s.endswith('"Yes."') for s in got)  # '."\n' belongs to the sentence it closes


def test_blank_lines_end_sentences_without_punctuation():
    assert [s.strip() for s in sentences("Title\n\nfirst line\nsecond line\n\nlast")] == [
        "Title", "first line\nsecond line", "last"]


def test_no_punctuation_at_all_is_cut_by_max_tokens():
    tok = make_tokenizer()
    ids = torch.tensor([tok(" ".join(["the committee"] * 150))["input_ids"]])
    n = ids.shape[1]
    assert int(sentence_ids(tok, ids).max()) == 0  # one sentence: no spread to measure
    lengths = torch.bincount(sentence_ids(tok, ids, max_tokens=64)[0])
    assert len(lengths) == -(-n // 64) and int(lengths.max()) <= 64  # equal pieces, the last one shorter
    assert int(lengths.max() - lengths.min()) < len(lengths)


def test_one_huge_sentence_is_cut_at_mean_plus_two_std():
    ids = torch.tensor([0] * 10 + [1] * 12 + [2] * 11 + [3] * 200 + [4] * 9 + [5] * 10 + [6] * 10 + [7] * 12)
    cut = split_long(ids.numpy(), None, floor=1)
    lengths = torch.bincount(torch.from_numpy(cut))
    assert cut.tolist() == sorted(cut.tolist()) and len(lengths) > 8
    limit = torch.tensor([10, 12, 11, 200, 9, 10, 10, 12.0])
    limit = limit.mean() + 2 * limit.std(unbiased=False)
    assert lengths.max() <= limit and lengths[:3].tolist() == [10, 12, 11]  # normal sentences untouched
    assert split_long(ids.numpy(), None).max() > 7  # the default floor of 32 tokens: the 200 still cut
    uniform = torch.tensor([0] * 10 + [1] * 10 + [2] * 10 + [3] * 25)
    assert split_long(uniform.numpy(), None).tolist() == uniform.tolist()  # 25 tokens: under the floor


def test_padding_is_minus_one_and_rows_independent():
    tok = make_tokenizer()
    ids = tok("One. Two three. Four.")["input_ids"]
    padded = torch.tensor([[0, 0] + ids, ids[:2] + ids])
    valid = torch.ones_like(padded, dtype=torch.bool)
    valid[0, :2] = False
    out = sentence_ids(tok, padded, valid)
    assert out[0, :2].tolist() == [-1, -1]
    assert torch.equal(out[0, 2:], sentence_ids(tok, torch.tensor([ids]))[0])


def test_closing_tokens():
    tok = make_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in [".", ".Ċ", '?"', '."Ċ', "Ċ", "Ġend", "3", "(x"]}
    closing = closes_sentence(tok, torch.tensor(list(ids.values()))).tolist()
    assert dict(zip(ids, closing)) == {".": True, ".Ċ": True, '?"': True, '."Ċ': True, "Ċ": True, "Ġend": False,
                                       "3": False, "(x": False}
    # An id past the tokenizer's (a model's vocabulary padded beyond it) ends no sentence.
    assert closes_sentence(tok, torch.tensor([len(tok), len(tok) + 100])).tolist() == [False, False]


def test_token_texts_decodes_each_token_alone_in_order():
    """Each distinct id is decoded once, and every token gets its own id's text, in the prompt's order: the same
    list as decoding every token alone (repeated ids, a special token, a character split over byte tokens)."""
    tok = make_tokenizer()
    ids = tok("é. Ünïcode — ab ab ab. 東京 ab")["input_ids"] + [tok.eos_token_id, 5, 5]
    expected = [tok.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids]
    assert len(set(ids)) < len(ids)
    assert token_texts(tok, ids) == expected
