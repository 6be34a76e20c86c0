"""Head-wise layers in lanes (`sparsekv.lanes`): the same tokens as the padded slot table, the same attention, the
same generations, in the memory of the budget."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import DEVICE, byte_tokenizer, make_model, prompt

from sparsekv import AdaKVPress, KVzipPress, SnapKVPress, SparseCache
from sparsekv.attention import lane_attention
from sparsekv.lanes import LANES_PER_HEAD, pack, unpacked
from sparsekv.layers import KVLayer
from sparsekv.prefill import Prefill


def head_table(counts: list[list[int]], width: int, d: int = 8, seed: int = 0):
    """A slot table `(batch, heads, width)` whose heads hold `counts` real tokens, fillers first (as `keep`)."""
    g = torch.Generator().manual_seed(seed)
    b, h = len(counts), len(counts[0])
    valid = torch.zeros(b, h, width, dtype=torch.bool)
    for i, row in enumerate(counts):
        for j, n in enumerate(row):
            valid[i, j, width - n:] = True
    positions = torch.rand(b, h, width, generator=g).argsort(-1) * valid
    keys, values = torch.randn(b, h, width, d, generator=g), torch.randn(b, h, width, d, generator=g)
    return keys, values, positions, valid


def test_lanes_hold_each_heads_tokens_and_little_more():
    counts = [[40, 3, 17, 0], [9, 30, 30, 12]]
    keys, values, positions, valid = head_table(counts, width=40)
    lanes = pack(keys, values, positions, valid)
    n_lanes, cap = lanes.valid.shape[1:]
    assert lanes.counts(4).tolist() == counts
    assert n_lanes * cap <= max(map(sum, counts)) + 4 * cap  # at most one lane partly filled per head
    assert cap == -(-max(map(sum, counts)) // (4 * LANES_PER_HEAD))
    table = lanes.table(4)
    assert torch.equal(table["valid"], valid)  # fillers first, then each head's tokens in slot order
    for name, t in (("keys", keys), ("values", values), ("positions", positions)):
        expected = t * (valid[..., None] if t.dim() == 4 else valid)
        assert torch.equal(table[name], expected)


class Module:
    scaling = 8 ** -0.5


@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_lane_attention_is_softmax_over_the_heads_own_tokens(q, masked):
    """Lanes and slots read in one softmax per query head equal sdpa over the padded table with per-head masks."""
    counts = [[20, 5], [11, 16]]
    keys, values, positions, valid = head_table(counts, width=20)
    g = torch.Generator().manual_seed(1)
    b, h_kv, group, d = 2, 2, 3, 8
    query = torch.randn(b, h_kv * group, q, d, generator=g)
    own_k, own_v = torch.randn(b, h_kv, q + 2, d, generator=g), torch.randn(b, h_kv, q + 2, d, generator=g)
    mask = torch.ones(b, 1, q, q + 2, dtype=torch.bool).tril(2)  # two earlier tokens, then causal
    if masked:
        mask[1, :, :, 0] = False  # (a filler slot of the slot table)
    got, _ = lane_attention(Module(), query, own_k, own_v, mask, pack(keys, values, positions, valid))
    all_k, all_v = torch.cat([keys, own_k], 2), torch.cat([values, own_v], 2)
    full = torch.cat([valid[:, :, None].expand(-1, -1, q, -1), mask.expand(-1, h_kv, -1, -1)], -1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, all_k.repeat_interleave(group, 1), all_v.repeat_interleave(group, 1),
        attn_mask=full.repeat_interleave(group, 1), scale=Module.scaling)
    torch.testing.assert_close(got, expected.transpose(1, 2))


def run(model, press, ids, mask, packed: bool, monkeypatch, **kwargs):
    with monkeypatch.context() as m:
        if not packed:
            m.setattr("sparsekv.cache.pack_layers", lambda cache: None)
        with press(model):
            return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True, **kwargs)


PRESSES = {"adakv": lambda: AdaKVPress(SnapKVPress(ratio=0.25, window_size=4)),
           "kvzip": lambda: KVzipPress(byte_tokenizer(), ratio=0.25, min_budget=8)}


@pytest.mark.parametrize("name", sorted(PRESSES))
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_head_wise_cache_in_lanes_decodes_as_the_padded_table(name, impl, monkeypatch):
    """A left-padded batch: the same tokens and logits as the padded slot table, with each layer's heads in
    lanes and no filler slot held."""
    model = make_model("llama", impl=impl)
    ids = prompt(96, batch=2, seed=3).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    padded, lanes = (run(model, PRESSES[name](), ids, mask, packed, monkeypatch) for packed in (False, True))
    assert torch.equal(padded.sequences, lanes.sequences)
    for a, b in zip(padded.scores, lanes.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    layers = [layer for layer in lanes.cache.layers if isinstance(layer, KVLayer)]
    assert all(layer.lanes is not None and layer.heads_agree for layer in layers)
    for a, b in zip(layers, (layer for layer in padded.cache.layers if isinstance(layer, KVLayer))):
        assert torch.equal(a.tokens_held(), b.tokens_held())


def test_beam_search_and_a_pickled_cache_continue_as_the_padded_table(monkeypatch):
    model = make_model("llama")
    ids = prompt(80, seed=4).to(DEVICE)
    mask = torch.ones_like(ids)
    beams = [run(model, PRESSES["adakv"](), ids, mask, packed, monkeypatch, num_beams=3).sequences
             for packed in (False, True)]
    assert torch.equal(*beams)
    press = PRESSES["adakv"]()
    with press(model):
        out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        saved = pickle.loads(pickle.dumps(out.cache))
        assert saved.layers[1].lanes is not None
        step = out.sequences[:, -1:]
        torch.testing.assert_close(model(step, cache=out.cache).logits, model(step, cache=saved).logits)


def test_lanes_hold_the_budget_not_the_widest_head():
    """AdaKV-SnapKV's cache holds within a tenth of SnapKV's KV at the same ratio (the padded table: the widest
    head's slots times the heads)."""
    model = make_model("llama")
    ids = prompt(1024, seed=6).to(DEVICE)
    held = {}
    for name, press in (("snapkv", SnapKVPress(ratio=0.25)), ("adakv", AdaKVPress(SnapKVPress(ratio=0.25)))):
        with press(model):
            cache = model(ids).cache
        layers = [layer for layer in cache.layers if isinstance(layer, KVLayer)]
        held[name] = sum(t.numel() for layer in layers for t in layer.attended_tensors())
    assert held["adakv"] <= 1.1 * held["snapkv"]


def test_rows_joined_keep_their_lanes_and_the_batch_holds_lanes_too():
    """Rows prefilled apart under head-wise budgets and joined (`SparseCache.join`): each row's cache keeps its
    lanes, and the batch holds the lanes a batch prefilled together holds, not its widest head's slots times the
    heads. (That it decodes as that batch: tests/test_join.py.)"""
    model = make_model("llama")
    ids = prompt(160, batch=2, seed=5).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    press = PRESSES["adakv"]()
    with press(model), torch.no_grad():
        together = model(ids, attention_mask=mask, position_ids=positions).cache
        parts = [model(ids[i:i + 1], attention_mask=mask[i:i + 1], position_ids=positions[i:i + 1]).cache
                 for i in range(2)]
        before = [[layer.tokens_held() for layer in part.compressed_layers()] for part in parts]
        joined = SparseCache.join(parts)
    for part, held in zip(parts, before):
        layers = part.compressed_layers()
        assert all(layer.lanes is not None for layer in layers)
        assert all(torch.equal(layer.tokens_held(), h) for layer, h in zip(layers, held))

    def kv(layers) -> int:
        return sum(t.numel() for layer in layers for t in layer.attended_tensors())

    layers = joined.compressed_layers()
    assert all(layer.lanes is not None for layer in layers)
    assert kv(layers) == kv(together.compressed_layers())
    assert kv(layers) < kv(unpacked(layer) for layer in layers)  # the padded table


def test_a_recorded_prefill_compresses_into_lanes():
    """`Prefill.compress` (the evaluation's, outside the press's block) holds head-wise layers in lanes, as the
    press's own prefill does, and the two caches decode alike."""
    model = make_model("llama")
    ids = prompt(96, seed=7).to(DEVICE)
    press = PRESSES["adakv"]()
    recorded = Prefill.run(model, ids).compress(press)
    with press(model), torch.no_grad():
        own = model(ids, cache=press.make_cache(model)).cache
        step = ids[:, -1:]
        logits = [model(step, cache=cache).logits for cache in (recorded, own)]
    for a, b in zip(recorded.compressed_layers(), own.compressed_layers()):
        assert a.lanes is not None and b.lanes is not None
        assert torch.equal(a.tokens_held(), b.tokens_held())
    torch.testing.assert_close(*logits)
