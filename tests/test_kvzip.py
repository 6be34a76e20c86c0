"""KVzipPress: reconstruction scores are the model's own attention, one budget across layers and heads, rows
reconstructed one by one, the same cache from generate and from a replayed prefill."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_tokenizer, make_model, prompt

from sparsekv import KVzipPress
from sparsekv.lanes import held_table
from sparsekv.layers import KVLayer
from sparsekv.prefill import Prefill
from sparsekv.presses.kvzip import FIRST


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def kept(cache) -> list[torch.Tensor]:
    """Per compressed layer, `(batch, kv_heads)` the real tokens it holds."""
    return [layer.tokens_held() for layer in cache.layers if isinstance(layer, KVLayer)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_scores_are_the_reconstructions_own_attention(tok, arch):
    """With the whole prompt in one chunk and no sinks, the softmax runs over every key: each token's score is
    the most attention the model itself pays it from a reconstructing query (eager attention's weights of the
    prompt followed by the instruction, the template's tail and the prompt again)."""
    model = make_model(arch, "eager").double()
    ids = prompt(40, seed=2)
    press = KVzipPress(tok, ratio=0.5, n_sink=0, chunk_size=64, min_budget=1)
    prefill = Prefill.run(model, ids)
    cache = press.make_cache(model)
    cache.layers = prefill.cache.layers  # the prompt, held whole (what `compress` leaves)
    with press(model):  # (the press's hooks hand its reconstruction's layer events to it)
        got = press.reconstruction_scores(model, cache, ids[0], 0, press.instruction())
    probe = tok(FIRST, add_special_tokens=False).input_ids + press.instruction()[1]
    full = torch.cat([ids, torch.tensor([probe]), ids], dim=1)
    out = model(full, output_attentions=True)
    n, groups = ids.shape[1], model.config.num_attention_heads // model.config.num_key_value_heads
    for layer, weights in zip(got, out.attentions):
        expected = weights[0, :, n:, :n].reshape(-1, groups, full.shape[1] - n, n).amax(dim=(1, 2))
        torch.testing.assert_close(layer.double(), expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("layerwise", [False, True])
def test_one_budget_across_layers_and_heads(tok, layerwise):
    """Each row keeps its budget times heads times layers in all (the sinks among them, in every head); with
    `layerwise`, budget times heads in each layer, shared by its heads."""
    model = make_model("llama")
    ids = prompt(120, seed=3)
    press = KVzipPress(tok, ratio=0.25, chunk_size=50, layerwise=layerwise, min_budget=8)
    cache = Prefill.run(model, ids).compress(press)
    counts = torch.stack(kept(cache))  # (layers, batch, heads)
    heads, budget = counts.shape[-1], 30
    if layerwise:
        assert counts.sum(-1).flatten().tolist() == [budget * heads] * counts.shape[0]
    else:
        assert int(counts.sum()) == budget * heads * counts.shape[0]
        assert len(set(counts.flatten().tolist())) > 1  # budgets differ between layers and heads
    for layer in cache.layers:
        positions, valid = held_table(layer)  # (its lanes and slots)
        real = positions.masked_fill(~valid, -1)
        assert all(set(range(4)) <= set(real[0, h].tolist()) for h in range(real.shape[1]))  # the sinks


def test_rows_of_a_padded_batch_are_reconstructed_alone(tok):
    """A left-padded batch keeps, per row, the tokens that row keeps alone."""
    model = make_model("llama").double()
    press = KVzipPress(tok, ratio=0.3, chunk_size=32, min_budget=8)
    ids = prompt(70, batch=2, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    together = Prefill.run(model, ids.masked_fill(mask == 0, 0), mask).compress(press)
    for row, start in ((0, 0), (1, 9)):
        alone = Prefill.run(model, ids[row:row + 1, start:]).compress(press)
        for both, one in zip(together.layers, alone.layers):  # (each layer's lanes and slots: `held_table`)
            (positions, valid), (one_positions, one_valid) = held_table(both), held_table(one)
            held = positions[row].masked_fill(~valid[row], -1) - start
            for h in range(held.shape[0]):
                mine = set(one_positions[0, h][one_valid[0, h]].tolist())
                assert mine and set(held[h][held[h] >= 0].tolist()) == mine


def test_generate_keeps_what_the_replayed_prefill_keeps(tok):
    """generate's prefill under the press and `Prefill.compress` (sparsekv eval's) build the same cache."""
    model = make_model("llama")
    ids = prompt(90, seed=5)
    press = KVzipPress(tok, ratio=0.25, chunk_size=40, min_budget=8)
    cache = press.make_cache(model)
    with press(model):
        out = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
    replay = Prefill.run(model, ids)
    assert replay.generate(press, max_new_tokens=6).tolist() == out.tolist()
    replayed = replay.compress(press)
    for a, b in zip(cache.layers, replayed.layers):  # (each layer's lanes and slots: `held_table`)
        (a_pos, a_valid), (b_pos, b_valid) = held_table(a), held_table(b)
        prompt_slots = a_pos < ids.shape[1]
        assert sorted(a_pos[prompt_slots & a_valid].tolist()) == sorted(b_pos[b_valid].tolist())


def test_refusals(tok):
    with pytest.raises(ValueError, match="tokenizer is required"):
        KVzipPress(ratio=0.5)
    with pytest.raises(ValueError, match="budget=2 must be at least min_budget=64"):
        KVzipPress(tok, budget=2)
    with pytest.raises(ValueError, match="budget=4 must be at least n_sink=8"):
        KVzipPress(tok, budget=4, n_sink=8, min_budget=2)
    from conftest import make_tokenizer

    model = make_model("llama")
    with pytest.raises(ValueError, match="exceed the model's vocabulary; give the press the model's own tokenizer"):
        with KVzipPress(make_tokenizer(), ratio=0.5, min_budget=8)(model):
            model.generate(prompt(60, seed=1).clamp(max=250) + 5, max_new_tokens=2)
