"""SentencePress: sentence store off the attention's device, per-sentence retrieval that follows the query."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import greedy, make_model, make_tokenizer, prompt

from sparsekv import KVLayer, SentenceKVPress, SentencePress, SparseCache
from sparsekv.cache import GROW
from sparsekv.presses.sentencekv import rank_in_sentence


def press(**kw):
    return SentencePress(make_tokenizer(), **{"n_sinks": 4, "window_size": 8, **kw})


def sentence_prompt(n: int, seed: int = 0) -> torch.Tensor:
    """Random ids with a sentence end (".") every 6 to 15 tokens."""
    ids = prompt(n, seed=seed)
    period = make_tokenizer().convert_tokens_to_ids(".")
    g = torch.Generator().manual_seed(seed)
    i = 0
    while i < n:
        i += int(torch.randint(6, 16, (1,), generator=g))
        if i < n:
            ids[0, i] = period
    return ids


def compressed(cache):
    return [layer for layer in cache.layers if isinstance(layer, KVLayer)]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_budget_and_memory_held_at_every_step(impl):
    model = make_model("qwen2", impl)
    n, tau, r = 120, 30, 2
    p = press(budget=tau, keep_factor=r)
    with p(model), torch.no_grad():
        out = model(sentence_prompt(n))
        cache = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
        for step in range(1, 16):
            out = model(token, past_key_values=cache)
            token = out.logits[:, -1:].argmax(-1)
            for layer in compressed(cache):
                assert layer.keys.shape[-2] == tau + step  # tau prompt slots + generated tokens
                assert int(layer.valid.sum()) == tau + step  # every slot real: 18 loaded + 4 sinks + 8 recent
                prompt_slots = layer.positions[0, :, layer.positions[0, 0] < n]
                assert prompt_slots.shape[-1] == tau and (prompt_slots[:, :4] >= 0).all()
                assert set(range(4)) <= set(prompt_slots[0].tolist()) and set(range(n - 8, n)) <= set(
                    prompt_slots[0].tolist())
                assert layer.store_keys.shape[-2] == r * tau - 12  # r * tau kept, sinks and window on device
                assert layer.store_keys.device == torch.device(p.offload_device)
                assert layer.store_keys.data_ptr() != layer.keys.data_ptr()
    stats = cache.stats()
    per_token = 2 * 2 * 16 * 4  # keys + values, 2 KV heads, head_dim 16, float32
    # tau + 15 generated slots, in a buffer made at the first step with GROW free slots for in-place appends
    assert stats.kv_bytes == len(compressed(cache)) * (tau + 1 + GROW) * per_token
    assert stats.offloaded_bytes == len(compressed(cache)) * (r * tau - 12) * per_token
    assert stats.counts["selections"] == 15 * len(compressed(cache))
    assert 0 < stats.counts["loads"] <= stats.counts["selections"]
    assert {"compress", "select", "load"} <= set(stats.seconds)


def fake_call(queries):
    """What `on_queries` reads from an attention call: this step's queries and their validity."""
    valid = torch.ones(queries.shape[0], queries.shape[2], dtype=torch.bool)
    return SimpleNamespace(queries=lambda: queries, input_valid=None, valid=lambda: valid)


def fake_cache():
    """What a press's decoding hooks read and write on the cache: timers, counters, the sentence-end flags."""
    return SimpleNamespace(seconds={"select": 0.0, "load": 0.0}, counts={"loaded_tokens": 0, "loads": 0,
                                                                         "selections": 0},
                           state=SimpleNamespace(closing=None))


def two_sentence_layer(p, fill: int = 4, loaded: int = 4):
    """A compressed layer, 1 KV head: `loaded` slots (`fill` of them real) and a store of two 4-token sentences
    whose mean keys are e0 and e1 (positions 100-103, 104-107)."""
    layer = p.new_layer(0)
    d, store = 4, 8
    layer.update(torch.zeros(1, 1, loaded + 12, d), torch.zeros(1, 1, loaded + 12, d))  # + 12 resident slots
    layer.compressed, layer.loaded, layer.fill = True, loaded, torch.tensor([[[fill]]])
    keys = torch.zeros(1, 1, store, d)
    keys[..., :4, 0], keys[..., 4:, 1] = 1.0, 1.0  # sentence 0: direction e0, sentence 1: e1
    keys[..., 2] = torch.arange(store)  # tells the tokens apart
    layer.store_keys, layer.store_values = keys, -keys
    layer.store_positions = torch.arange(100, 100 + store)[None]
    layer.slot_sentence = torch.tensor([[[0, 0, 0, 0, 1, 1, 1, 1]]])
    layer.slot_rank, layer.sentence_sizes = rank_in_sentence(layer.slot_sentence, 2), torch.tensor([[[4, 4]]])
    layer.sentence_keys = torch.tensor([[1.0, 0, 1.5, 0], [0, 1.0, 5.5, 0]])[None, None]
    layer.query_sum = torch.zeros(1, 1, d)
    layer.device_slot = torch.zeros(1, 1, store, dtype=torch.long)
    return layer


def loaded_positions(layer, n: int) -> list[int]:
    """Positions of the first `n` loaded slots, sorted, after checking each slot holds its store token's KV."""
    positions = layer.positions[0, 0, :n]
    expected = layer.store_keys[0, 0, positions - 100]
    assert torch.equal(layer.keys[0, 0, :n], expected) and torch.equal(layer.values[0, 0, :n], -expected)
    return sorted(positions.tolist())


def test_selection_follows_the_query_and_resets_at_sentence_ends():
    """Two sentences with orthogonal mean keys: the loaded one is the one the generated sentence's mean query
    points at, and it changes once a sentence ends and the next one points elsewhere."""
    p = press(budget=16)  # 4 loaded slots
    layer, d = two_sentence_layer(p), 4
    cache = fake_cache()
    toward = lambda i: torch.eye(d)[i].view(1, 1, 1, d)  # noqa: E731
    p.on_queries(cache, layer, fake_call(toward(0)))
    assert loaded_positions(layer, 4) == [100, 101, 102, 103]
    p.after_step(cache, layer, None)
    p.on_queries(cache, layer, fake_call(2 * toward(1)))  # the mean of e0 and 2 e1 still leans to e1
    assert loaded_positions(layer, 4) == [104, 105, 106, 107] and cache.counts["loads"] == 2
    p.on_queries(cache, layer, fake_call(toward(1)))  # same selection: nothing loaded
    assert cache.counts["loads"] == 2 and cache.counts["selections"] == 3 and cache.counts["loaded_tokens"] == 8
    cache.state.closing = torch.tensor([True])
    p.after_step(cache, layer, None)  # the sentence ended: a fresh mean query
    assert not layer.query_sum.any()
    p.on_queries(cache, layer, fake_call(0.1 * toward(0)))
    assert loaded_positions(layer, 4) == [100, 101, 102, 103]


def test_only_tokens_entering_the_selection_are_copied():
    """6 loaded slots: the best sentence whole, then the other's first 2 tokens. When the query turns, the 4
    tokens kept by both selections stay in their slots; the 2 that enter take the slots of the 2 that leave."""
    p = press(budget=18)
    layer = two_sentence_layer(p, fill=6, loaded=6)
    cache = fake_cache()
    p.on_queries(cache, layer, fake_call(torch.eye(4)[0].view(1, 1, 1, 4)))
    assert loaded_positions(layer, 6) == [100, 101, 102, 103, 104, 105]
    before = layer.positions[0, 0, :6].clone()
    p.on_queries(cache, layer, fake_call(3 * torch.eye(4)[1].view(1, 1, 1, 4)))
    assert loaded_positions(layer, 6) == [100, 101, 104, 105, 106, 107]
    stayed = torch.isin(before, torch.tensor([100, 101, 104, 105]))
    assert torch.equal(layer.positions[0, 0, :6][stayed], before[stayed])  # not moved
    assert cache.counts["loaded_tokens"] == 6 + 2


def test_a_row_filling_fewer_slots_loads_its_best_tokens_and_leaves_the_filler():
    p = press(budget=16)
    layer = two_sentence_layer(p, fill=3)
    cache = fake_cache()
    p.on_queries(cache, layer, fake_call(torch.eye(4)[1].view(1, 1, 1, 4)))
    assert loaded_positions(layer, 3) == [104, 105, 106]  # sentence 1's first three tokens
    assert layer.positions[0, 0, 3] == 3 and not layer.keys[0, 0, 3].any()  # the filler slot is never written


def test_sentence_ranks():
    sentence = torch.tensor([[0, 0, 2, 2, 2, 1, 3, 3]])  # ids need not follow positions (split sentences)
    assert rank_in_sentence(sentence, 4).tolist() == [[0, 1, 0, 1, 2, 0, 0, 1]]


def test_ratio_one_is_identical():
    model = make_model("llama")
    ids = sentence_prompt(70)
    with press(ratio=1.0)(model):
        out = greedy(model, ids, new=8)
    assert torch.equal(out, greedy(model, ids, new=8))


def test_alias_repr_and_errors():
    assert SentenceKVPress is SentencePress
    assert "tokenizer" not in repr(press(budget=64))
    with pytest.raises(ValueError, match="tokenizer is required"):
        SentencePress(budget=64)
    with pytest.raises(ValueError, match="keep_factor must be a number >= 1"):
        press(budget=64, keep_factor=0.5)
    with pytest.raises(ValueError, match="offload_device"):
        press(budget=64, offload_device="floppy")
    model = make_model("llama")
    with press(budget=12)(model), pytest.raises(ValueError, match="n_sinks=4 \\+ window_size=8 \\+ 1"):
        model(prompt(40))
    with press(budget=20)(model), pytest.raises(ValueError, match="needs input_ids"):
        model(inputs_embeds=model.get_input_embeddings()(prompt(40)))
    assert isinstance(SparseCache(press(budget=20), model.config).layers[0], KVLayer)
