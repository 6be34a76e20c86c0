"""Per-head validity: the heads of a row may hold different numbers of real tokens (head-wise budgets), and
attention reads each head's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import DEVICE, greedy, make_model, prompt
from transformers import CompileConfig

from sparsekv import ScorerPress
from sparsekv.layers import KVLayer
from sparsekv.masks import physical_mask


@dataclass
class HeadBudgetPress(ScorerPress):
    """Keeps the keys of largest norm, `shares[h]` of the row's budget on KV head `h` (1.0 for every head: the
    row budget, through the head-wise path)."""

    shares: tuple[float, ...] = (1.0, 1.0)

    def score(self, ctx):
        return ctx.keys.float().norm(dim=-1)

    def head_budgets(self, ctx, scores, budgets):
        share = torch.tensor(self.shares, device=budgets.device)
        return (budgets[:, None] * share).round().long()


@dataclass
class DecodingHeadBudgetPress(HeadBudgetPress):
    """`HeadBudgetPress` holding its budgets while decoding: a step evicts the keys of smallest norm."""

    compiled_decoding: ClassVar[bool] = True

    def score_step(self, ctx):
        return ctx.keys.float().norm(dim=-1)


@dataclass
class RowNormPress(ScorerPress):
    """`HeadBudgetPress`'s scores under the row budgets of `ScorerPress`."""

    score = HeadBudgetPress.score


def filled_layer(b: int = 2, h: int = 2, n: int = 12) -> KVLayer:
    layer = KVLayer()
    keys = torch.randn(b, h, n, 4, generator=torch.Generator().manual_seed(0))
    layer.update(keys, keys.clone())
    return layer


def test_keep_gives_each_head_its_own_budget_fillers_first_then_tokens_by_position():
    layer = filled_layer()
    scores = layer.keys.norm(dim=-1)
    budgets = torch.tensor([[5, 2], [3, 4]])
    layer.keep(scores, budgets)
    assert not layer.heads_agree and layer.slots == 5
    assert torch.equal(layer.valid.sum(-1), budgets)
    for row in range(2):
        for head in range(2):
            k = int(budgets[row, head])
            valid = layer.valid[row, head]
            assert not valid[: 5 - k].any() and valid[5 - k:].all()  # fillers first
            kept = layer.positions[row, head, 5 - k:]
            assert torch.equal(kept, kept.sort().values)
            assert set(kept.tolist()) == set(scores[row, head].topk(k).indices.tolist())


def test_row_budgets_keep_every_head_of_a_row_alike():
    layer = filled_layer()
    layer.keep(layer.keys.norm(dim=-1), torch.tensor([5, 2]))
    assert layer.heads_agree
    assert torch.equal(layer.valid.sum(-1), torch.tensor([[5, 5], [2, 2]]))
    assert torch.equal(layer.valid[:, 0], layer.valid[:, 1])


def test_a_steps_victims_are_each_heads_own_filler_until_its_budget_then_its_lowest_token():
    layer = filled_layer()
    layer.keep(layer.keys.norm(dim=-1), torch.tensor([[5, 2], [3, 4]]))
    new = torch.randn(2, 2, 1, 4, generator=torch.Generator().manual_seed(1))
    layer.update(new, new.clone())
    held = [[set(layer.positions[r, h][layer.valid[r, h]].tolist()) for h in range(2)] for r in range(2)]
    norms = {(r, h): dict(zip(layer.positions[r, h].tolist(), layer.keys[r, h].norm(dim=-1).tolist()))
             for r in range(2) for h in range(2)}
    budgets = torch.tensor([[5, 3], [3, 5]])  # heads (0, 1) and (1, 1) have room for the step's token
    layer.hold_budget(layer.keys.norm(dim=-1), budgets, int(budgets.max()))
    assert layer.slots == 5
    assert torch.equal(layer.valid.sum(-1), budgets)
    for r in range(2):
        for h in range(2):
            kept = set(layer.positions[r, h][layer.valid[r, h]].tolist())
            if len(held[r][h]) <= budgets[r, h]:  # room: a filler slot takes the token
                assert kept == held[r][h]
            else:  # full: the lowest-scored of its tokens and the step's goes
                assert kept == held[r][h] - {min(held[r][h], key=norms[r, h].get)}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_per_head_mask_repeats_each_kv_heads_validity_for_its_query_heads(impl):
    past = torch.tensor([[[True, False, True], [False, True, True]]])  # (batch 1, kv_heads 2, slots 3)
    mask = physical_mask(past, torch.ones(1, 2, dtype=torch.bool), impl, torch.float32, groups=2)
    allowed = mask if impl == "sdpa" else mask == 0
    assert allowed.shape == (1, 4, 2, 5)
    for head in range(4):
        assert torch.equal(allowed[0, head, :, :3], past[0, head // 2].expand(2, 3))
        assert torch.equal(allowed[0, head, :, 3:], torch.tensor([[True, False], [True, True]]))


def test_flash_attention_refuses_heads_that_disagree():
    past = torch.tensor([[[True, False], [True, True]]])
    with pytest.raises(ValueError, match="attn_implementation=\"sdpa\""):
        physical_mask(past, torch.ones(1, 1, dtype=torch.bool), "flash_attention_2", torch.float16)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("padded", [False, True])
def test_head_wise_budgets_that_agree_decode_as_row_budgets(impl, padded):
    model = make_model("llama", impl=impl)
    ids = prompt(48, batch=2).to(DEVICE)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :10] = 0
    runs = []
    for press in (HeadBudgetPress(budget=16), RowNormPress(budget=16)):
        with press(model):
            runs.append(model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                       output_scores=True, return_dict_in_generate=True))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for a, b in zip(runs[0].scores, runs[1].scores):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_head_never_reads_the_tokens_it_did_not_keep(impl, monkeypatch):
    """Head 1 keeps a quarter of the row's budget, head 0 all of it: the slots head 1 leaves as fillers hold tokens
    head 0 keeps. Garbage written into them changes nothing: each head's mask is its own. (The padded table,
    which a press that scores its steps keeps: not moved into lanes.)"""
    monkeypatch.setattr("sparsekv.cache.pack_layers", lambda cache: None)
    model = make_model("llama", impl=impl)
    ids = prompt(48).to(DEVICE)
    press = HeadBudgetPress(budget=16, shares=(1.0, 0.25))
    with press(model):
        cache = model(ids).cache
        layers = [layer for layer in cache.layers if isinstance(layer, KVLayer)]
        assert all(torch.equal(layer.valid.sum(-1), torch.tensor([[16, 4]], device=DEVICE)) for layer in layers)
        step = torch.tensor([[7]], device=DEVICE)
        state = {i: (layer.keys.clone(), layer.values.clone()) for i, layer in enumerate(layers)}
        before = model(step, cache=cache).logits
        for layer in layers:
            layer.crop_to(layer.logical_len - 1)
        for (keys, values), layer in zip(state.values(), layers):
            garbage = ~layer.valid[..., None]
            layer.keys.copy_(keys.masked_fill(garbage, 1e4))
            layer.values.copy_(values.masked_fill(garbage, -1e4))
        after = model(step, cache=cache).logits
    torch.testing.assert_close(before, after)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_each_head_holds_its_own_budget_while_decoding(compiled):
    """Heads given 8 and 24 of a row's 16 at the prompt hold 8 and 24 at every step after it, evicting each its
    own lowest-scored token (not the row's 16 on both: the head given less would fill back up); on a cache laid
    out for compiled steps too (each layer's room up to its own largest budget)."""
    model = make_model("llama")
    ids = prompt(40).to(DEVICE)
    press = DecodingHeadBudgetPress(budget=16, shares=(0.5, 1.5))
    expected = torch.tensor([[8, 24]], device=DEVICE)
    with press(model):
        cache = press.make_cache(model, compiled=compiled, max_new_tokens=6 if compiled else None)
        out = model(ids, cache=cache)
        for _ in range(6):
            out = model(out.logits[:, -1:].argmax(-1), cache=cache)
            for layer in cache.compressed_layers():
                assert torch.equal(layer.valid.sum(-1), expected)
                assert layer.slots == 24


def test_head_wise_budgets_held_while_decoding_compile_with_the_eager_tokens():
    """The same press, generate's decoding steps traced (dynamo, the graphs run as traced): the eager tokens, and
    each head at its own budget after them."""
    model = make_model("llama")
    ids = prompt(40).to(DEVICE)
    press = DecodingHeadBudgetPress(budget=16, shares=(0.5, 1.5))
    config = CompileConfig(backend=lambda gm, inputs: gm.forward, mode=None)
    config._compile_all_devices = True  # (transformers compiles on a CPU only when told to)
    torch._dynamo.reset()
    try:
        with press(model):
            eager = greedy(model, ids, new=6)
            cache = press.make_cache(model, compiled=True, max_new_tokens=6)
            compiled = greedy(model, ids, new=6, cache=cache, compile_config=config)
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled, eager)
    for layer in cache.compressed_layers():
        assert torch.equal(layer.valid.sum(-1), torch.tensor([[8, 24]], device=DEVICE))
