"""transformers pipelines: the standard text-generation pipeline inside a press, and sparsekv's own task."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import CHAT_TEMPLATE, TRICKY, make_model, make_tokenizer
from test_core import PRESSES
from transformers import GenerationConfig, pipeline

from sparsekv import SnapKVPress, SparseCache, StreamingLLMPress
from sparsekv.evaluation import Sample, encode
from sparsekv.evaluation.runner import answer

CONTEXT = TRICKY * 3
QUESTIONS = ["Who paid for the edition?", "What did the committee review?"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = copy.deepcopy(make_tokenizer())
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_model("llama", "sdpa", vocab_size=len(tokenizer))


def test_text_generation_pipeline_runs_compressed(model, tokenizer):
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    press = StreamingLLMPress(budget=16, window_size=1)
    caches = []
    hook = model.register_forward_hook(lambda m, args, kwargs, out: caches.append(out.cache),
                                       with_kwargs=True)
    try:
        with press(model):
            text = pipe(CONTEXT, max_new_tokens=5, do_sample=False, return_full_text=False)[0]["generated_text"]
    finally:
        hook.remove()
    assert caches and all(isinstance(cache, SparseCache) for cache in caches)
    assert max(caches[-1].stats().resident_tokens) <= 16  # the budget held while the pipeline decoded
    ids = tokenizer(CONTEXT, return_tensors="pt").input_ids
    with press(model):
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert text == tokenizer.decode(reference[0, ids.shape[1]:], skip_special_tokens=True)


def test_questions_answered_from_one_compressed_context(model, tokenizer):
    press = SnapKVPress(window_size=8, ratio=0.3)
    pipe = pipeline("sparsekv-text-generation", model=model, tokenizer=tokenizer, press=press)
    out = pipe(CONTEXT, questions=QUESTIONS, max_new_tokens=6)
    # Each answer is the eval's question-agnostic answer: context compressed alone, then the question.
    for question, got in zip(QUESTIONS, out["answers"]):
        prompt = encode(tokenizer, Sample(context=CONTEXT, question=question, answers=[]))
        assert got == answer(model, tokenizer, press, prompt, "agnostic", 6)[0]
    assert out["context_tokens"] == prompt.context_ids.shape[1]
    assert out["resident_tokens"] == pytest.approx(round(0.3 * out["context_tokens"]), abs=1)
    assert out["kv_bytes"] < 0.35 * out["full_kv_bytes"]
    # Questions do not see each other: the second one asked alone gets the same answer.
    assert pipe(CONTEXT, question=QUESTIONS[1], max_new_tokens=6)["answers"] == out["answers"][1:]


def test_without_a_press_answers_equal_plain_generate(model, tokenizer):
    pipe = pipeline("sparsekv-text-generation", model=model, tokenizer=tokenizer)
    out = pipe(CONTEXT, questions=QUESTIONS, max_new_tokens=6)
    assert out["kv_bytes"] == out["full_kv_bytes"] and out["resident_tokens"] == out["context_tokens"]
    config = GenerationConfig(do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id)
    for question, got in zip(QUESTIONS, out["answers"]):
        ids = encode(tokenizer, Sample(context=CONTEXT, question=question, answers=[])).ids
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert got == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_every_press_answers(model, tokenizer, name):
    pipe = pipeline("sparsekv-text-generation", model=model, tokenizer=tokenizer, press=PRESSES[name](ratio=0.4))
    out = pipe(CONTEXT, questions=QUESTIONS, max_new_tokens=4)
    assert len(out["answers"]) == 2 and all(isinstance(a, str) for a in out["answers"])
    assert 0 < out["resident_tokens"] <= out["context_tokens"]


@pytest.mark.parametrize("kwargs, message", [
    ({}, "questions"),
    ({"questions": []}, "questions"),
    ({"questions": ["ok", ""]}, "questions"),
    ({"question": "a", "questions": ["b"]}, "not both"),
    ({"question": "a", "max_new_tokens": 0}, "max_new_tokens"),
])
def test_bad_input_is_named(model, tokenizer, kwargs, message):
    pipe = pipeline("sparsekv-text-generation", model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=message):
        pipe(CONTEXT, **kwargs)


def test_empty_context_is_an_error(model, tokenizer):
    pipe = pipeline("sparsekv-text-generation", model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="context"):
        pipe("  ", question="Anything?")
