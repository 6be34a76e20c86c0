"""ChunkPress: whole chunks kept within the budget, scored as the paper says, and reused across layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, make_model, prompt

from sparsekv import ChunkKVPress, ChunkPress, KVLayer, SnapKVPress, SparseCache
from sparsekv.presses.chunkkv import ChunkState


def compressed(cache):
    return [layer for layer in cache.layers if isinstance(layer, KVLayer)]


def prefill(model, press, ids, mask=None):
    with press(model), torch.no_grad():
        return model(ids, attention_mask=mask).cache


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_kept_chunks_are_whole_aligned_and_within_budget(impl):
    model = make_model("qwen2", impl, num_hidden_layers=4)
    n, w, c, budget = 97, 8, 10, 40
    cache = prefill(model, ChunkPress(budget=budget, window_size=w, chunk_size=c, reuse_layers=1), prompt(n))
    for layer in compressed(cache):
        positions = layer.positions[0]
        assert (positions == positions[:1]).all(), "every head of a layer keeps the same tokens"
        kept = set(positions[0].tolist())
        assert set(range(n - w, n)) <= kept  # the window
        assert budget - c < len(kept) <= budget
        for p in kept - set(range(n - w, n)):
            chunk = range(p // c * c, min(p // c * c + c, n - w))
            assert set(chunk) <= kept, f"chunk of token {p} kept partly"


def test_selection_matches_chunk_sums_of_the_full_attention():
    """Chunks ranked by SnapKV's window attention computed from the full eager attention matrix."""
    model = make_model("llama", "eager", num_hidden_layers=2)
    ids, w, c, budget = prompt(88), 8, 5, 38
    attn = model(ids, output_attentions=True).attentions
    cache = prefill(model, ChunkPress(budget=budget, window_size=w, chunk_size=c, reuse_layers=1), ids)
    for layer_idx, layer in enumerate(compressed(cache)):
        a = attn[layer_idx][0, :, -w:, :].sum(1).view(2, 2, 88).mean(1)  # window sum, GQA group mean
        a = F.max_pool1d(a[:, None], 7, stride=1, padding=3)[:, 0].sum(0)  # pooled, summed over KV heads
        chunk_sums = a[: 88 - w].view(-1, c).sum(-1)  # 80 tokens before the window: 16 chunks
        best = set(chunk_sums.topk((budget - w) // c).indices.tolist())
        kept = set(layer.positions[0, 0].tolist()) - set(range(88 - w, 88))
        assert {p // c for p in kept} == best


def test_partial_last_chunk_scored_by_its_mean_and_padding_never_kept():
    press = ChunkPress(budget=14, window_size=4, chunk_size=10)
    n, start = 31, 2  # two padding tokens, then 25 tokens in chunks of 10, 10, 5, then the 4-token window
    token = torch.full((n,), 0.8)
    token[start + 20 : start + 25] = 1.0  # the partial chunk: mean 1.0 (sum 5) beats the others' mean 0.8 (sum 8)
    token[:start] = 100.0  # padding scores must not count
    valid = torch.ones(1, n, dtype=torch.bool)
    valid[0, :start] = False
    scores = press.select_chunks(token.expand(1, 2, n) / 2, valid, torch.tensor([start]), torch.tensor([14]))
    chosen = (scores[0, 0] > float("-inf")).nonzero().flatten().tolist()
    # room 10: the partial chunk (5 tokens) first, then no full chunk fits
    assert chosen == list(range(start + 20, start + 25)) + list(range(n - 4, n))
    assert len(chosen) == 9  # the core keeps those alone (scored above -inf), under a budget of 14


def test_reused_layers_keep_their_group_leaders_indices():
    model = make_model("llama", num_hidden_layers=5)
    ids = prompt(120)
    kw = dict(ratio=0.3, window_size=8, chunk_size=6)
    every = [layer.positions for layer in compressed(prefill(model, ChunkPress(reuse_layers=1, **kw), ids))]
    reused = [layer.positions for layer in compressed(prefill(model, ChunkPress(reuse_layers=2, **kw), ids))]
    for i, leader in enumerate([0, 0, 2, 2, 4]):
        assert torch.equal(reused[i], every[leader]), i  # leaders select as without reuse; the others copy
    assert not torch.equal(every[0], every[1])  # so the test can tell reuse from chance


def test_reuse_skips_scoring(monkeypatch):
    model = make_model("llama", num_hidden_layers=4)
    calls = []
    real = SnapKVPress.window_scores
    monkeypatch.setattr(SnapKVPress, "window_scores", lambda self, *a: calls.append(1) or real(self, *a))
    for reuse, expected in [(1, 4), (2, 2), (3, 2), (4, 1)]:
        calls.clear()
        prefill(model, ChunkPress(ratio=0.3, window_size=8, reuse_layers=reuse), prompt(80))
        assert len(calls) == expected, reuse


def test_groups_follow_compressed_layers_only():
    model = make_model("gemma3", num_hidden_layers=5,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                                    "full_attention"])
    cache = SparseCache(ChunkPress(ratio=0.5, reuse_layers=2), model.config)
    assert cache.state.leader == {1: 1, 3: 1, 4: 4}


def test_batch_rows_choose_their_own_chunks():
    model = make_model("llama")
    rows = [prompt(70, seed=5)[0], prompt(100, seed=6)[0]]
    ids = torch.zeros(2, 100, dtype=torch.long, device=DEVICE)
    mask = torch.zeros(2, 100, dtype=torch.long, device=DEVICE)
    for i, row in enumerate(rows):
        ids[i, 100 - len(row) :], mask[i, 100 - len(row) :] = row, 1
    press = ChunkPress(ratio=0.4, window_size=8, chunk_size=7)
    batched = prefill(model, press, ids, mask)
    for i, row in enumerate(rows):
        alone = prefill(model, press, row[None])
        offset = 100 - len(row)
        for a, b in zip(compressed(batched), compressed(alone)):
            real = a.valid[i, 0]
            assert torch.equal(a.positions[i][:, real] - offset, b.positions[0]), i


def test_layer_jaccard_on_a_constructed_cache():
    model = make_model("llama", num_hidden_layers=3)
    cache = SparseCache(ChunkPress(ratio=0.5), model.config)
    cache.begin_forward(None, None, 10, 1)
    kept = [([0, 1, 2, 3], [5, 6, 7, 8]), ([2, 3, 4, 5], [5, 6, 7, 8]), ([2, 3, 4, 5], [0, 1, 2, 9])]
    for layer, heads in zip(cache.layers, kept):
        layer.update(torch.zeros(1, 2, 10, 16), torch.zeros(1, 2, 10, 16))
        layer.select(torch.tensor([heads]), torch.ones(1, 4, dtype=torch.bool))
    # layer 0 vs 1: head 0 shares {2, 3} of 6 tokens, head 1 all 4; layer 1 vs 2: 1 and 0
    assert cache.stats().layer_jaccard == pytest.approx([(2 / 6 + 1) / 2, 0.5])


def test_chunks_are_more_alike_across_layers_than_tokens():
    """The paper's observation (57.7% vs 28.0% on LLaMA-3-8B), on a random tiny model: only the direction."""
    model = make_model("llama", num_hidden_layers=4)
    ids = prompt(300)
    chunks = prefill(model, ChunkPress(ratio=0.2, window_size=8, reuse_layers=1), ids).stats().layer_jaccard
    tokens = prefill(model, SnapKVPress(ratio=0.2, window_size=8), ids).stats().layer_jaccard
    assert len(chunks) == 3 and sum(chunks) > sum(tokens)


def test_alias_state_and_errors():
    assert ChunkKVPress is ChunkPress
    assert isinstance(SparseCache(ChunkPress(ratio=0.5), make_model().config).state, ChunkState)
    for bad in [dict(chunk_size=0), dict(reuse_layers=0), dict(chunk_size=2.5)]:
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
            ChunkPress(ratio=0.5, **bad)
    with pytest.raises(ValueError, match="window_size"):
        ChunkPress(budget=16)  # below the 32-token window
