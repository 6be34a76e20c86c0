"""kvpress's simple scorers as sparsekv presses (Knorm, KeyDiff, TOVA): each keeps what its score says, per row of
a padded batch; every generate mode is the generate-mode matrix's (they join it by existing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import greedy, make_model, prompt
from test_core import left_padded

from sparsekv import KeyDiffPress, KnormPress, TOVAPress


def full_keys(model, ids, mask) -> list[torch.Tensor]:
    """Each layer's keys of the prompt without a press: what a press's prefill scores (compression happens after
    a layer's attention, so no layer's input changes)."""
    return [layer.keys for layer in model(ids, attention_mask=mask).cache.layers]


def knorm(keys, real):
    return -keys.norm(dim=-1)


def keydiff(keys, real):
    unit = F.normalize(keys, dim=-1)
    anchor = (unit * real[:, None, :, None]).sum(2, keepdim=True) / real.sum(-1)[:, None, None, None]
    return -F.cosine_similarity(unit, anchor, dim=-1)


@pytest.mark.parametrize("press_cls, score", [(KnormPress, knorm), (KeyDiffPress, keydiff)], ids=["Knorm", "KeyDiff"])
def test_a_scorer_keeps_each_rows_best_keys(press_cls, score):
    """Per layer, row and KV head, the positions kept are the budget's best by the paper's score, computed here
    from the uncompressed keys of each row's real tokens (KeyDiff's anchor over them alone)."""
    model = make_model("llama")
    ids, mask = left_padded((48, 40), 48)
    keys = full_keys(model, ids, mask)
    with press_cls(ratio=0.25, min_budget=4)(model):
        cache = model(ids, attention_mask=mask).cache
    real = mask.bool()
    for layer, k in zip(cache.compressed_layers(), keys):
        scores = score(k.float(), real.float()).masked_fill(~real[:, None, :], float("-inf"))
        for row, n in enumerate((48, 40)):
            budget = round(0.25 * n)
            best = scores[row].topk(budget, dim=-1).indices.sort(-1).values  # (heads, budget): padded indices
            held = layer.positions[row][:, layer.valid[row, 0]].sort(-1).values
            assert torch.equal(held, best), (press_cls.__name__, row)


def test_tova_holds_one_layout_for_every_head_and_its_budget_while_decoding():
    """TOVA averages all of a layer's heads: every KV head keeps the same tokens, the prompt's last among them,
    and each row holds its budget from the prompt to the last token (a row kept whole grows to it first)."""
    model = make_model("llama")
    ids, mask = left_padded((64, 30), 64)
    with TOVAPress(budget=24, min_budget=8)(model):
        prompt_cache = model(ids, attention_mask=mask).cache
        out = greedy(model, ids, mask, new=12, return_dict_in_generate=True, suppress_tokens=[2])
    for layer in prompt_cache.compressed_layers():
        assert bool((layer.positions[0] == 63).any(-1).all())  # the last prompt token, in every head
    for layer in out.cache.compressed_layers():
        held = [layer.positions[row][:, layer.valid[row, 0]].sort(-1).values for row in range(2)]
        assert all(h.shape[-1] == 24 for h in held)
        assert all(bool((h == h[:1]).all()) for h in held)  # one layout for every KV head
    plain = greedy(model, prompt(20), new=6)
    with TOVAPress(ratio=0.1)(model):  # at its defaults, a short prompt and its answer are untouched
        assert torch.equal(greedy(model, prompt(20), new=6), plain)
