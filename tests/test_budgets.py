"""Budgets that differ between heads (AdaKV) and between layers (PyramidKV): what each keeps, and that both serve
generate as the presses they build on."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import greedy, make_model, prompt

from sparsekv import AdaKVPress, CHESSPress, H2OPress, KnormPress, PyramidKVPress, SnapKVPress
from sparsekv.layers import KVLayer


def padded_pair(length: int = 64, pad: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([prompt(length), prompt(length, seed=1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def held(cache) -> list[torch.Tensor]:
    """Real tokens `(batch, kv_heads)` of each compressed layer."""
    return [layer.tokens_held() for layer in cache.layers if isinstance(layer, KVLayer)]


def test_adakv_gives_each_head_its_share_of_the_rows_best_scores_taken_together():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 10, generator=g)
    scores[0, 0] += 3  # row 0's first head draws most of the attention
    scores[1, :, :2] = float("-inf")  # row 1's padding
    budgets = torch.tensor([4, 3])
    press = AdaKVPress(SnapKVPress(budget=4, window_size=1), alpha_safeguard=0.0)
    shares = press.head_budgets(None, scores, budgets)
    for row in range(2):
        best = scores[row].flatten().topk(int(budgets[row]) * 3).indices // 10
        assert shares[row].tolist() == torch.bincount(best, minlength=3).tolist()
    assert shares.sum(-1).tolist() == [12, 9] and shares[0, 0] > 4


def test_adakvs_safeguard_keeps_each_heads_share_of_the_uniform_budget():
    scores = torch.zeros(1, 2, 20)
    scores[0, 0] = 10 + torch.arange(20.0)  # head 0 outscores head 1 everywhere
    budgets = torch.tensor([10])
    shares = [AdaKVPress(SnapKVPress(budget=10, window_size=1), alpha_safeguard=alpha).head_budgets(None, scores,
                                                                                                   budgets)
              for alpha in (0.0, 0.3, 1.0)]
    assert shares[0].tolist() == [[20, 0]]
    assert shares[1].tolist() == [[17, 3]]  # int(0.3 x 10) on head 1
    assert shares[2].tolist() == [[10, 10]]  # the uniform budgets


def test_adakv_keeps_a_short_rows_every_token_and_never_its_padding():
    scores = torch.randn(1, 2, 8)
    scores[..., :3] = float("-inf")
    assert AdaKVPress(SnapKVPress(budget=8, window_size=1)).head_budgets(None, scores, torch.tensor([8])).tolist() \
        == [[5, 5]]


@torch.no_grad()
def test_adakvs_layers_hold_the_rows_budget_over_their_heads_each_head_at_least_its_safeguard():
    model = make_model("llama")
    ids, mask = padded_pair()
    with AdaKVPress(SnapKVPress(budget=16, window_size=4))(model):
        out = greedy(model, ids, mask, new=1, return_dict_in_generate=True)
    layers = held(out.cache)
    for tokens in layers:
        assert tokens.sum(-1).tolist() == [2 * 16, 2 * 16]
        assert (tokens >= int(16 * 0.2)).all()
    assert any(len(set(tokens.flatten().tolist())) > 1 for tokens in layers)  # the heads' shares differ


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@torch.no_grad()
def test_adakv_with_the_whole_safeguard_decodes_as_its_press(impl):
    """alpha_safeguard=1: every head keeps the uniform budget, its best tokens: the wrapped press's tokens and
    logits, through the head-wise path."""
    model = make_model("llama", impl=impl)
    ids, mask = padded_pair()
    runs = []
    for press in (SnapKVPress(ratio=0.25, window_size=8), AdaKVPress(SnapKVPress(ratio=0.25, window_size=8),
                                                                     alpha_safeguard=1.0)):
        with press(model):
            runs.append(greedy(model, ids, mask, new=8, output_scores=True, return_dict_in_generate=True))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for a, b in zip(runs[0].scores, runs[1].scores):
        torch.testing.assert_close(a, b)


def test_adakv_takes_its_budget_from_the_press_it_wraps_and_gives_it_one_set_on_it():
    press = AdaKVPress(KnormPress(budget=32, min_budget=8))
    assert (press.ratio, press.budget) == (None, 32)
    changed = dataclasses.replace(press, ratio=0.5, budget=None)
    assert changed.press == KnormPress(ratio=0.5, min_budget=8) and changed.ratio == 0.5
    assert AdaKVPress(SnapKVPress(ratio=0.25), compile=True).press.compile


@pytest.mark.parametrize("press", [H2OPress(ratio=0.25), CHESSPress(ratio=0.25)], ids=lambda p: p.label())
def test_adakv_refuses_a_press_that_does_not_keep_by_its_scores(press):
    with pytest.raises(ValueError, match=f"press must be a scoring press.*got {type(press).__name__}"):
        AdaKVPress(press)


def test_adakv_refuses_a_safeguard_outside_zero_to_one():
    with pytest.raises(ValueError, match="alpha_safeguard"):
        AdaKVPress(SnapKVPress(ratio=0.25), alpha_safeguard=1.5)


@pytest.mark.parametrize("lengths", [[4000, 4000], [600, 1000]])
def test_pyramidkvs_layers_shrink_with_depth_and_keep_the_rows_budget_on_the_mean(lengths):
    press = PyramidKVPress(ratio=0.25, window_size=32)
    lengths = torch.tensor(lengths)
    budgets = press.prompt_budgets(lengths)
    layers = torch.stack([press.layer_budgets(budgets, lengths, rank, 30) for rank in range(30)])  # (layers, b)
    assert (layers[:-1] >= layers[1:]).all() and (layers[0] > layers[-1]).all()
    assert (layers >= 32).all() and (layers <= lengths).all()
    assert ((layers.double().mean(0) - budgets).abs() <= 0.5).all()
    assert layers[-1, 0] == round(max(32, float(budgets[0]) / 20))  # the paper's top layer: the mean / beta


def test_pyramidkv_keeps_a_short_rows_every_token_on_every_layer():
    press = PyramidKVPress(budget=64, window_size=8)
    lengths = torch.tensor([40, 400])
    budgets = press.prompt_budgets(lengths)
    assert [int(press.layer_budgets(budgets, lengths, rank, 3)[0]) for rank in range(3)] == [64, 64, 64]


@torch.no_grad()
def test_pyramidkv_holds_its_pyramid_in_each_layer():
    model = make_model("llama")
    ids, mask = padded_pair(length=96)
    press = PyramidKVPress(ratio=0.5, window_size=4, beta=4)
    with press(model):
        out = greedy(model, ids, mask, new=1, return_dict_in_generate=True)
    budgets = press.prompt_budgets(mask.sum(-1))
    expected = [press.layer_budgets(budgets, mask.sum(-1), rank, 3) for rank in range(3)]
    assert [tokens[:, 0].tolist() for tokens in held(out.cache)] == [e.tolist() for e in expected]
    assert expected[0][0] > expected[2][0]


def test_adakv_is_named_by_a_spec_over_snapkv_or_the_press_it_names():
    from sparsekv import make_press

    assert make_press("adakv:ratio=0.1") == AdaKVPress(SnapKVPress(ratio=0.1))
    assert make_press("adakv:press=knorm,alpha_safeguard=0.5", ratio=0.2) == AdaKVPress(KnormPress(ratio=0.2),
                                                                                        alpha_safeguard=0.5)
    with pytest.raises(ValueError, match="AdaKVPress: press='nope'.*unknown press"):
        AdaKVPress(press="nope", ratio=0.1)
