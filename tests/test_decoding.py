"""DecodingPress: any scoring press holds a budget while decoding, cutting the cache back every `interval` steps."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy, make_model, prompt

from sparsekv import (
    AdaKVPress, CHESSPress, ChunkPress, DecodingPress, ExpectedAttentionPress, H2OPress, KeyDiffPress, KnormPress,
    PyramidKVPress, SnapKVPress, TOVAPress,
)
from sparsekv.presses.registry import make_press


def held_per_step(model, press, ids, mask=None, new=20):
    """Real tokens each row holds in layer 0 after the prompt and after every decoding step `(steps, batch)`,
    the slots of the table, and the generation."""
    rows, slots = [], []
    with press(model):
        cache = press.make_cache(model)

        class Clock:
            def put(self, value):
                layer = cache.layers[0]
                if layer.keys is not None:
                    rows.append(layer.valid[:, 0].sum(-1).clone())
                    slots.append(layer.slots)

            def end(self):
                pass

        out = greedy(model, ids, mask, new=new, cache=cache, streamer=Clock())
    return torch.stack(rows), slots, out, cache


@pytest.mark.parametrize("interval", [1, 4, 7])
def test_the_budget_is_held_cut_every_interval(interval):
    model = make_model("llama").double()
    ids = prompt(64, seed=1)
    budget = 24
    rows, slots, _, _ = held_per_step(model, DecodingPress(SnapKVPress(budget=budget, window_size=8),
                                                           interval=interval), ids, new=24)
    held = rows[:, 0].tolist()
    assert held[0] == budget  # the prompt, compressed by SnapKV
    # then one more each step, and every `interval` steps cut back to the budget
    expected = [budget + (step % interval) for step in range(len(held))]
    assert held == expected and max(slots) == budget + interval - 1


def test_rows_of_a_padded_batch_hold_their_own_budgets():
    model = make_model("llama").double()
    ids = prompt(80, batch=2, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0  # row 1: a prompt of 40 tokens
    rows, _, out, _ = held_per_step(model, DecodingPress(SnapKVPress(ratio=0.25, window_size=8), interval=5),
                                    ids, mask, new=16)
    budgets = torch.tensor([20, 10])
    assert torch.equal(rows[0], budgets)
    assert bool((rows <= budgets + 4).all()) and bool((rows[5] == budgets).all())
    # each row generates what it generates alone
    alone, _, alone_out, _ = held_per_step(model, DecodingPress(SnapKVPress(ratio=0.25, window_size=8), interval=5),
                                           ids[1:, 40:], None, new=16)
    assert torch.equal(alone[:, 0], rows[:, 1])
    assert torch.equal(alone_out[0, 40:], out[1, 80:])


def test_a_budget_above_the_generation_changes_nothing():
    model = make_model("llama").double()
    ids = prompt(48, seed=2)
    with DecodingPress(SnapKVPress(budget=500, window_size=8), interval=3)(model):
        pressed = greedy(model, ids, new=20)
    assert torch.equal(pressed, greedy(model, ids, new=20))


def test_the_prompt_left_whole_is_cut_at_the_first_step():
    model = make_model("llama").double()
    ids = prompt(64, seed=4)
    press = DecodingPress(SnapKVPress(budget=24, window_size=8), interval=4, compress_prompt=False)
    rows, _, _, _ = held_per_step(model, press, ids, new=6)
    assert rows[0, 0] == 64 and rows[1, 0] == 24


@pytest.mark.parametrize("interval", [1, 6])
def test_a_cut_keeps_the_window_of_the_newest_tokens(interval):
    """SnapKV's window at a cut is the newest tokens (their queries score the rest), and it is always kept, also
    when a cut comes at every step (the slots stay in position order: SnapKV's window is its newest slots)."""
    model = make_model("llama").double()
    ids = prompt(64, seed=5)
    _, _, out, cache = held_per_step(model, DecodingPress(SnapKVPress(budget=24, window_size=8), interval=interval),
                                     ids, new=19)  # 18 decoding steps: a cut at the last
    layer = cache.layers[0]
    newest = torch.arange(out.shape[1] - 9, out.shape[1] - 1)  # the 8 newest in the cache (the last token is not)
    assert layer.slots == 24
    for head in range(layer.positions.shape[1]):
        assert set(newest.tolist()) <= set(layer.positions[0, head].tolist())


@pytest.mark.parametrize("press", [KnormPress(budget=24, min_budget=8), KeyDiffPress(budget=24, min_budget=8),
                                   ExpectedAttentionPress(budget=24, n_sink=4, min_budget=8),
                                   ChunkPress(budget=24, window_size=8, chunk_size=4),
                                   AdaKVPress(SnapKVPress(budget=24, window_size=8))], ids=lambda p: type(p).__name__)
def test_every_scoring_press_holds_the_budget(press):
    model = make_model("qwen3").double()
    ids = prompt(64, seed=6)
    _, _, _, cache = held_per_step(model, DecodingPress(press, interval=4), ids, new=17)  # 16 steps: cut at the last
    for layer in cache.layers:  # (AdaKV: the heads of a row share its budget)
        held = layer.valid.sum(-1)
        assert int(held.sum()) <= 24 * held.shape[1] if isinstance(press, AdaKVPress) else int(held.max()) <= 24


def test_refusals_name_what_to_do():
    with pytest.raises(ValueError, match="already evicts at every decoding step"):
        DecodingPress(H2OPress(budget=64))
    with pytest.raises(ValueError, match="already evicts at every decoding step"):
        DecodingPress(TOVAPress(budget=64))
    with pytest.raises(ValueError, match="keeps by a rule of its own"):
        DecodingPress(CHESSPress(ratio=0.25))
    with pytest.raises(ValueError, match="wrap SnapKVPress"):
        DecodingPress(PyramidKVPress(budget=32))
    with pytest.raises(ValueError, match="interval"):
        DecodingPress(SnapKVPress(budget=32), interval=0)
    with pytest.raises(TypeError, match="compress_prompt"):
        DecodingPress(SnapKVPress(budget=32), compress_prompt="yes")
    with pytest.raises(ValueError, match="compile"):
        DecodingPress(SnapKVPress(budget=32), compile=True)


def test_a_spec_names_the_wrapped_press_and_gives_it_the_budget():
    press = make_press("decoding:press=knorm,interval=8", budget=64)
    assert isinstance(press.press, KnormPress) and press.press.budget == 64 and press.interval == 8
    assert DecodingPress(SnapKVPress(ratio=0.5), budget=48).press.budget == 48


def test_the_perplexity_benchmark_scores_each_token_given_the_cache_before_it():
    """`benchmarks.decoding_perplexity`: token by token over the full cache, each token's loss is the one a
    single forward over the whole text gives it; under DecodingPress with room for every token, the same."""
    from benchmarks.decoding_perplexity import token_losses

    model = make_model("llama").double()
    ids = prompt(40, seed=7)
    losses, held = token_losses(model, ids, 8)
    whole = torch.nn.functional.cross_entropy(model(ids).logits[0, 7:-1], ids[0, 8:], reduction="none")
    assert torch.allclose(torch.tensor(losses, dtype=whole.dtype), whole.detach()) and held == 39
    pressed, _ = token_losses(model, ids, 8, DecodingPress(SnapKVPress(budget=100, window_size=4), interval=3))
    assert torch.allclose(torch.tensor(pressed), torch.tensor(losses))
    small, held = token_losses(model, ids, 8, DecodingPress(SnapKVPress(budget=12, window_size=4), interval=3))
    assert held <= 14 and small != losses
