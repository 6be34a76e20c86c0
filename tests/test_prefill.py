"""One recorded prefill replayed under many presses gives exactly what `generate` under each press gives."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, greedy, make_model, make_tokenizer, prompt

from sparsekv import ChunkPress, H2OPress, SentencePress, SnapKVPress, StreamingLLMPress
from sparsekv.prefill import Prefill

PRESSES = [SnapKVPress(ratio=0.3, window_size=8), H2OPress(ratio=0.3, window_size=1),
           StreamingLLMPress(budget=24, window_size=1),
           ChunkPress(ratio=0.3, window_size=8, chunk_size=5),
           SentencePress(make_tokenizer(), ratio=0.4, n_sinks=4, window_size=8)]


def padded(rows):
    n = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long, device=DEVICE)
    mask = torch.zeros(len(rows), n, dtype=torch.long, device=DEVICE)
    for i, row in enumerate(rows):
        ids[i, n - len(row):] = row
        mask[i, n - len(row):] = 1
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_replayed_presses_generate_what_generate_does(arch, impl):
    model = make_model(arch, impl)
    ids, mask = padded([prompt(60, seed=3)[0], prompt(90, seed=4)[0]])
    prefill = Prefill.run(model, ids, mask)
    assert torch.equal(prefill.generate(None, max_new_tokens=10, do_sample=False, pad_token_id=0),
                       greedy(model, ids, mask, new=10))
    for press in PRESSES:
        with press(model):
            expected = greedy(model, ids, mask, new=10)
            inside = prefill.generate(press, max_new_tokens=10, do_sample=False, pad_token_id=0)
        outside = prefill.generate(press, max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(inside, expected), press
        assert torch.equal(outside, expected), press


def test_replayed_cache_equals_generates_cache():
    model = make_model("qwen3", "sdpa")
    ids = prompt(70)
    press = SnapKVPress(ratio=0.25, window_size=8)
    with press(model):
        direct = model(ids).cache
    replayed = Prefill.run(model, ids).compress(press)
    assert replayed.stats().resident_tokens == direct.stats().resident_tokens
    for a, b in zip(direct.layers, replayed.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.positions, b.positions) and torch.equal(a.valid, b.valid)
    assert replayed.seconds["compress"] > 0


def test_prefill_is_reusable_and_untouched_by_presses():
    model = make_model("llama")
    prefill = Prefill.run(model, prompt(50))
    keys = [layer.keys.clone() for layer in prefill.cache.layers]
    first = prefill.generate(StreamingLLMPress(budget=16, window_size=1), max_new_tokens=6, do_sample=False)
    prefill.generate(H2OPress(ratio=0.2, window_size=1), max_new_tokens=6, do_sample=False)
    again = prefill.generate(StreamingLLMPress(budget=16, window_size=1), max_new_tokens=6, do_sample=False)
    assert torch.equal(again, first)
    assert all(torch.equal(k, layer.keys) for k, layer in zip(keys, prefill.cache.layers))


def test_first_token_eos_and_single_token():
    model = make_model("llama")
    prefill = Prefill.run(model, prompt(30))
    top = int(prefill.logits[0, -1].argmax())
    out = prefill.generate(SnapKVPress(ratio=0.5, window_size=4), max_new_tokens=5, do_sample=False, eos_token_id=top)
    assert out.shape[1] == 31 and int(out[0, -1]) == top
    assert prefill.generate(None, max_new_tokens=1, do_sample=False).shape[1] == 31


def test_prefill_errors():
    model = make_model("llama")
    with pytest.raises(ValueError, match="do_sample"):
        Prefill.run(model, prompt(20)).generate(None, max_new_tokens=3, do_sample=True)
    with SnapKVPress(ratio=0.5)(model), pytest.raises(ValueError, match="outside"):
        Prefill.run(model, prompt(20))


def test_prompt_work_done_once_per_prompt(monkeypatch):
    """Scores that do not depend on the budget are computed once for every ratio replayed on one prompt."""
    calls = []
    real_window, real_received = SnapKVPress._window_scores, H2OPress.received
    monkeypatch.setattr(SnapKVPress, "_window_scores", lambda *a: calls.append("window") or real_window(*a))
    monkeypatch.setattr(H2OPress, "received", lambda *a: calls.append("h2o") or real_received(*a))
    model = make_model("llama")  # 3 layers
    prefill = Prefill.run(model, prompt(80))
    for ratio in (0.5, 0.3, 0.2):
        # SnapKV with ChunkKV's kernel: the same window scores, shared
        for press in (SnapKVPress(ratio=ratio, window_size=8, kernel_size=7),
                      ChunkPress(ratio=ratio, window_size=8, reuse_layers=1),
                      H2OPress(ratio=ratio, window_size=1)):
            prefill.compress(press)
    assert calls.count("window") == 3 and calls.count("h2o") == 3
    prefill.compress(SnapKVPress(ratio=0.5, window_size=16))  # another window: other scores
    assert calls.count("window") == 6
    with H2OPress(ratio=0.5, window_size=1)(model):  # outside a replay nothing is shared
        model(prompt(80))
        model(prompt(80))
    assert calls.count("h2o") == 9
